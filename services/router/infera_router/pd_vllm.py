"""vLLM's Mooncake connector: the prefill leg runs first with ``max_tokens`` 1 and
``kv_transfer_params`` asking for a remote decode; the decode leg then pulls the KV from the
prefill's bootstrap server, named by address, engine id and the pair's transfer id. A prefill with
several DP ranks has one engine id per rank (``<id>_dp<rank>``): the decode names the pinned one."""

from __future__ import annotations

from typing import Any

from infera_router.pd_protocol import PdContext, bootstrap_endpoint
from infera_router.state import WorkerState


def remote_engine_id(prefill: WorkerState) -> str | None:
    pd = prefill.record.pd
    base = pd.engine_id if pd is not None else None
    if base is None or prefill.record.dp_size <= 1 or prefill.rank is None:
        return base
    return f"{base}_dp{prefill.rank}"


class VllmMooncake:
    name = "vllm-mooncake"
    sequential = True

    def context(self, prefill: WorkerState) -> PdContext:
        return PdContext()

    def prefill_body(self, body: dict[str, Any], prefill: WorkerState, ctx: PdContext) -> dict[str, Any]:
        out = {**body, "max_tokens": 1, "stream": False,
               "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                      "transfer_id": ctx.transfer_id}}
        out.pop("stream_options", None)
        if "max_completion_tokens" in out:
            out["max_completion_tokens"] = 1
        return out

    def decode_body(self, body: dict[str, Any], prefill: WorkerState, decode: WorkerState,
                    ctx: PdContext) -> dict[str, Any]:
        host, port = bootstrap_endpoint(prefill.record)
        return {**body, "kv_transfer_params": {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_bootstrap_addr": f"http://{host}:{port}" if port else f"http://{host}",
            "remote_engine_id": remote_engine_id(prefill), "transfer_id": ctx.transfer_id,
        }}
