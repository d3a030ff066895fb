"""SGLang's bootstrap protocol: the same body to both legs, with the prefill's bootstrap address and
a random room; both legs run at once and the decode waits for its room's KV. With several prefill
DP ranks, the room decides the rank (``room % dp_size``), so the decode finds the KV there."""

from __future__ import annotations

from typing import Any

from infera_common.schemas import WorkerRecord

from infera_router.pd_protocol import PdContext, bootstrap_endpoint


class SglangBootstrap:
    name = "sglang-bootstrap"
    sequential = False

    def _with_room(self, body: dict[str, Any], prefill: WorkerRecord, ctx: PdContext) -> dict[str, Any]:
        host, port = bootstrap_endpoint(prefill)
        return {**body, "bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": ctx.room}

    def prefill_body(self, body: dict[str, Any], prefill: WorkerRecord, ctx: PdContext) -> dict[str, Any]:
        # the router drains the prefill answer: one whole response, not a stream
        out = self._with_room(body, prefill, ctx)
        out["stream"] = False
        out.pop("stream_options", None)
        return out

    def decode_body(self, body: dict[str, Any], prefill: WorkerRecord, ctx: PdContext) -> dict[str, Any]:
        return self._with_room(body, prefill, ctx)
