"""The registry of prefill/decode protocols, by the name a worker registers in ``pd.protocol``."""

from __future__ import annotations

from infera_router.pd_protocol import DisaggProtocol
from infera_router.pd_sglang import SglangBootstrap
from infera_router.pd_vllm import VllmMooncake

PROTOCOLS: dict[str, DisaggProtocol] = {p.name: p for p in (SglangBootstrap(), VllmMooncake())}
