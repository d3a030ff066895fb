"""What a request asks of the disaggregation machinery and of the DP ranks (pure: no I/O).

SGLang (body fields): `bootstrap_host`, `bootstrap_port`, `bootstrap_room` (int in [0, 2^63)) on both
the prefill and the decode request; `routed_dp_rank` (older `data_parallel_rank`) pins this engine's
DP rank; `disagg_prefill_dp_rank` tells a decode which prefill DP rank holds its KV (else
`bootstrap_room % prefill dp_size`).

vLLM (Mooncake connector): `kv_transfer_params` = `{do_remote_decode: true, do_remote_prefill: false,
transfer_id}` on the prefill, `{do_remote_prefill: true, do_remote_decode: false, remote_bootstrap_addr,
remote_engine_id, transfer_id}` on the decode; header `X-data-parallel-rank` pins the DP rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from infera_mock_engine.engine_errors import RequestError
from infera_mock_engine.pd_config import DEFAULT_BOOTSTRAP_PORT, DisaggConfig

MAX_ROOM = 2**63
TP_RANK = 0  # the mock has one TP rank per DP rank: SGLang's messages name it


@dataclass(frozen=True)
class PdRequest:
    role: str  # "prefill" | "decode": what this engine does for the request
    protocol: str  # "sglang" | "vllm"
    key: int | str  # bootstrap_room (sglang) | transfer_id (vllm)
    bootstrap_host: str | None = None  # sglang decode: where the prefill's bootstrap server is
    bootstrap_port: int | None = None
    prefill_dp_rank: int | None = None  # sglang decode: disagg_prefill_dp_rank
    remote_bootstrap_addr: str | None = None  # vllm decode
    remote_engine_id: str | None = None  # vllm decode

    @property
    def room(self) -> int | None:
        return self.key if self.protocol == "sglang" else None  # type: ignore[return-value]


@dataclass(frozen=True)
class Routing:
    """Where a request runs: a pinned DP rank (and the field that pinned it) and its PD part."""

    dp_rank: int | None = None
    dp_rank_field: str = "routed_dp_rank"
    pd: PdRequest | None = None


def routing(body: Any, headers: Mapping[str, str], flavor: str, disagg: DisaggConfig) -> Routing:
    """The routing of a request body (a protocol.PdFields model) and its headers; RequestError (400)
    when a disaggregated engine gets a request it cannot serve."""
    if flavor == "vllm":
        pinned, field = _header_rank(headers), "X-data-parallel-rank"
        pd = vllm_pd_request(disagg, body.kv_transfer_params)
    else:
        pinned, field = body.routed_dp_rank, "routed_dp_rank"
        if pinned is None and body.data_parallel_rank is not None:
            pinned, field = body.data_parallel_rank, "data_parallel_rank"
        pd = sglang_pd_request(disagg, body.bootstrap_host, body.bootstrap_port, body.bootstrap_room,
                               body.disagg_prefill_dp_rank)
    return Routing(pinned, field, pd)


def _header_rank(headers: Mapping[str, str]) -> int | None:
    text = headers.get("X-data-parallel-rank")
    if text is None or text == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise RequestError(f"X-data-parallel-rank: {text!r} is not an integer", param="X-data-parallel-rank") from None


def sglang_pd_request(disagg: DisaggConfig, host: str | None, port: int | None, room: int | None,
                      prefill_dp_rank: int | None) -> PdRequest | None:
    if disagg.protocol != "sglang" or not disagg.enabled:
        return None  # an aggregated engine ignores bootstrap fields, as SGLang does
    mode = disagg.mode
    missing = [name for name, value in (("bootstrap_room", room),) if value is None]
    if mode == "decode" and not host:
        missing.insert(0, "bootstrap_host")
    if missing:
        raise RequestError(
            f"this engine runs with --disaggregation-mode {mode}: the request needs {' and '.join(missing)} "
            "(a PD router adds bootstrap_host, bootstrap_port and bootstrap_room to both halves)",
            param=missing[0])
    if not 0 <= room < MAX_ROOM:  # type: ignore[operator]
        raise RequestError(f"bootstrap_room must be within [0, 2^63), got {room}", param="bootstrap_room")
    return PdRequest(role=mode, protocol="sglang", key=room, bootstrap_host=host,  # type: ignore[arg-type]
                     bootstrap_port=DEFAULT_BOOTSTRAP_PORT if port is None else port,
                     prefill_dp_rank=prefill_dp_rank)


def vllm_pd_request(disagg: DisaggConfig, params: Any) -> PdRequest | None:
    if disagg.protocol != "vllm" or not isinstance(params, Mapping):
        return None
    remote_decode, remote_prefill = bool(params.get("do_remote_decode")), bool(params.get("do_remote_prefill"))
    if not (remote_decode or remote_prefill):
        return None
    if remote_decode and remote_prefill:
        raise RequestError("kv_transfer_params: do_remote_decode and do_remote_prefill are both true",
                           param="kv_transfer_params")
    role = "prefill" if remote_decode else "decode"
    if not disagg.enabled:
        return None  # no KV connector: vLLM serves the request as an ordinary one
    if role == "prefill" and not disagg.serves_prefill or role == "decode" and not disagg.serves_decode:
        kv_role = (disagg.kv_transfer_config or {}).get("kv_role")
        raise RequestError(f"kv_transfer_params asks this engine to {role}, but its kv_role is {kv_role}",
                           param="kv_transfer_params")
    needed = ["transfer_id"] if role == "prefill" else ["remote_bootstrap_addr", "remote_engine_id", "transfer_id"]
    missing = [k for k in needed if not params.get(k)]
    if missing:
        raise RequestError(f"kv_transfer_params for a {role} request lacks {', '.join(missing)} "
                           "(vLLM would not transfer the KV at all)", param="kv_transfer_params")
    if role == "prefill":
        return PdRequest(role="prefill", protocol="vllm", key=str(params["transfer_id"]))
    return PdRequest(role="decode", protocol="vllm", key=str(params["transfer_id"]),
                     remote_bootstrap_addr=str(params["remote_bootstrap_addr"]),
                     remote_engine_id=str(params["remote_engine_id"]))


# ---- SGLang's failure messages (decode.py / prefill.py, KVTransferError) ----------------------------
def _kv_error(room: int | str, reason: str) -> str:
    return f"KVTransferError(bootstrap_room={room}): {reason}"


def decode_failed(rid: str, room: int | str, reason: str) -> str:
    return (f"Decode transfer failed for request rank={TP_RANK} decode_req.req.rid={rid!r} "
            f"decode_req.req.bootstrap_room={room} with exception {_kv_error(room, reason)}")


def prefill_bootstrap_failed(rid: str, room: int | str, reason: str) -> str:
    return (f"Prefill bootstrap failed for request rank={TP_RANK} req.rid={rid!r} req.bootstrap_room={room} "
            f"with exception {_kv_error(room, reason)}")


def prefill_transfer_failed(rid: str, room: int | str, reason: str) -> str:
    return (f"Prefill transfer failed for request rank={TP_RANK} req.rid={rid!r} req.bootstrap_room={room} "
            f"with exception {_kv_error(room, reason)}")


def timed_out(room: int | str, elapsed: float, state: str) -> str:
    return f"Request {room} timed out after {elapsed:.1f}s in KVPoll.{state}"


PREFILL_DEAD = "Failed to get kvcache from prefill instance, it might be dead"
VLLM_ERROR = "Internal server error"  # vLLM's GenerationError text for finish_reason "error"
