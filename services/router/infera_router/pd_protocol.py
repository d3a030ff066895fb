"""How a prefill/decode pair is told about each other: one ``DisaggProtocol`` per module. Pure.

A protocol turns the client's request body into the two legs' bodies. ``sequential`` protocols
need the prefill leg's answer before the decode leg can be sent (vLLM's Mooncake connector: the
prefill runs with ``max_tokens`` 1 and the decode then pulls its KV); the others send both legs at
once (SGLang's bootstrap rooms: the decode waits for its room's KV). The protocol is chosen from
the prefill worker's record (``pd.protocol``); adding one touches one new module and ``PROTOCOLS``.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any, Protocol

from infera_common.prompts import prompt_count
from infera_common.schemas import WorkerRecord

from infera_router.state import WorkerState


@dataclass(slots=True, frozen=True)
class PdContext:
    """What both legs of one pair share."""

    room: int = field(default_factory=lambda: secrets.randbits(63))  # SGLang bootstrap room in [0, 2^63)
    transfer_id: str = field(default_factory=lambda: secrets.token_hex(16))


def several_sequences(body: dict[str, Any]) -> str | None:
    """Why a request cannot go to a prefill/decode pair, or None: a pair shares one KV handover (one
    bootstrap room, one transfer id) per request, so a request that asks for several sequences
    (``n`` > 1 samples, or a completions batch of several prompts) has no way to name each one's."""
    n = body.get("n")
    if isinstance(n, int) and n > 1:
        return f"n={n}"
    prompts = prompt_count(body.get("prompt"))
    return f"a batch of {prompts} prompts" if prompts > 1 else None


class DisaggProtocol(Protocol):
    """``prefill``/``decode`` are the chosen routing targets: a worker, or one DP rank of it (``rank``)."""

    name: str
    sequential: bool

    def context(self, prefill: WorkerState) -> PdContext: ...

    def prefill_body(self, body: dict[str, Any], prefill: WorkerState, ctx: PdContext) -> dict[str, Any]: ...

    def decode_body(self, body: dict[str, Any], prefill: WorkerState, decode: WorkerState,
                    ctx: PdContext) -> dict[str, Any]: ...


def bootstrap_endpoint(prefill: WorkerRecord) -> tuple[str, int | None]:
    """Host and port of the prefill engine's bootstrap server (its advertise host by default)."""
    pd = prefill.pd
    host = (pd.bootstrap_host if pd is not None and pd.bootstrap_host else None) or prefill.advertise_host
    return host, pd.bootstrap_port if pd is not None else None
