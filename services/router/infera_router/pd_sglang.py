"""SGLang's bootstrap protocol: the same body to both legs, with the prefill's bootstrap address and
a random room; both legs run at once and the decode waits for its room's KV. With DP ranks, each
leg is pinned to its chosen rank (``routed_dp_rank``), the decode is told the prefill's rank
(``disagg_prefill_dp_rank``), and the room is drawn so that ``room % dp_size`` is that rank too (what
engines without the hint use)."""

from __future__ import annotations

import secrets
from typing import Any

from infera_common.dp_pin import pin_body
from infera_router.pd_protocol import PdContext, bootstrap_endpoint
from infera_router.state import WorkerState

ROOM_SPACE = 2**63


def aligned_room(rank: int | None, dp_size: int) -> int:
    """A random room in [0, 2^63) with ``room % dp_size == rank``."""
    room = secrets.randbelow(ROOM_SPACE)
    if rank is None or dp_size <= 1:
        return room
    room -= room % dp_size
    return room + rank if room + rank < ROOM_SPACE else room - dp_size + rank


class SglangBootstrap:
    name = "sglang-bootstrap"
    sequential = False

    def context(self, prefill: WorkerState) -> PdContext:
        return PdContext(room=aligned_room(prefill.rank, prefill.record.dp_size))

    def _with_room(self, body: dict[str, Any], prefill: WorkerState, ctx: PdContext) -> dict[str, Any]:
        host, port = bootstrap_endpoint(prefill.record)
        return {**body, "bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": ctx.room}

    def prefill_body(self, body: dict[str, Any], prefill: WorkerState, ctx: PdContext) -> dict[str, Any]:
        # the router drains the prefill answer: one whole response, not a stream
        out = pin_body(self._with_room(body, prefill, ctx), prefill.rank)
        out["stream"] = False
        out.pop("stream_options", None)
        return out

    def decode_body(self, body: dict[str, Any], prefill: WorkerState, decode: WorkerState,
                    ctx: PdContext) -> dict[str, Any]:
        out = pin_body(self._with_room(body, prefill, ctx), decode.rank)
        if prefill.rank is not None:
            out["disagg_prefill_dp_rank"] = prefill.rank
        return out
