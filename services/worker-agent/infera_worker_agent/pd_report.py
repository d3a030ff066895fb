"""The role and PD parameters the agent registers: the plan from the flags, then the engine's own
report once it runs. Pure.

Before health the record carries the plan (``pd_role``). After health the engine's report wins,
as for the KV block size:

- ``/server_info`` (SGLang, the mock): ``disaggregation_mode`` / the mock's ``disaggregation.mode``
  (an SGLang ``--config`` file can set it), ``dp_size``, the prefill's bound bootstrap port (the
  mock's ``disaggregation.bootstrap_port``, SGLang's ``disaggregation_bootstrap_port``) and, for
  the mock's vLLM flavour, the ``engine_id`` it resolved;
- vLLM (no /server_info): its Mooncake bootstrap server's ``GET /query``,
  ``{"<dp rank>": {"engine_id": ..., "worker_addr": ...}}``, gives the engine id vLLM generated.
  With DP the engine suffixes each rank's id (``<id>_dp<rank>``); the record holds the base id
  and ``dp_size``, from which rank r's id is ``<id>_dp<r>`` (``<id>`` itself when dp_size is 1).

The bootstrap host is the external bootstrap server's (vLLM ``bootstrap_server_address``) or the
agent's advertise host. Only a prefill registers a bootstrap address; an aggregated worker
registers no PD parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from infera_common.kv_endpoints import url_host
from infera_common.schemas import PdParams, Role
from infera_worker_agent.pd_role import PROTOCOLS, SGLANG_MODES, PdPlan

REPORTED_MODES = {**SGLANG_MODES, "both": None}  # the mock's vLLM kv_both: either role, keep the plan's


@dataclass(frozen=True, slots=True)
class PdState:
    role: Role
    pd: PdParams | None
    dp_size: int


def planned_state(plan: PdPlan, advertise_host: str) -> PdState:
    """What the engine's flags say, before the engine reports anything."""
    port = plan.bootstrap_port or None  # 0: the mock picks one and reports it
    return PdState(plan.role, _params(plan.role, plan.protocol, plan, advertise_host, port, plan.engine_id),
                   plan.dp_size)


def reported_state(
    plan: PdPlan, advertise_host: str, server_info: dict[str, Any] | None, bootstrap_query: Any = None
) -> tuple[PdState, list[str]]:
    """The state to register after health, and notes on where the engine's report overrode the plan."""
    info = server_info or {}
    desc = info.get("disaggregation") if isinstance(info.get("disaggregation"), dict) else {}
    notes: list[str] = []

    role = plan.role
    mode = desc.get("mode", info.get("disaggregation_mode"))
    reported = REPORTED_MODES.get(mode) if isinstance(mode, str) else None
    if reported is not None and reported is not role:
        notes.append(f"the engine reports disaggregation mode {mode!r}, its flags said {role.value}: "
                     f"registering {reported.value}")
        role = reported

    dp = _positive(info.get("dp_size")) or plan.dp_size
    protocol = plan.protocol or (PROTOCOLS[plan.family] if role is not Role.AGGREGATED else None)

    port = None
    if role is Role.PREFILL:
        if plan.bootstrap_host is None:  # the engine's own bootstrap server
            port = _port(desc.get("bootstrap_port")) or _port(info.get("disaggregation_bootstrap_port"))
        port = port or plan.bootstrap_port or None
        if port is None:
            notes.append("the prefill's bootstrap port is unknown: the engine did not report it")

    engine_id = plan.engine_id
    if plan.family == "vllm":
        engine_id = _text(desc.get("engine_id")) or query_engine_id(bootstrap_query, dp) or engine_id
        if role is Role.PREFILL and engine_id is None:
            notes.append("the prefill's engine id is unknown: set engine_id in --kv-transfer-config")
    return PdState(role, _params(role, protocol, plan, advertise_host, port, engine_id), dp), notes


def needs_bootstrap_query(plan: PdPlan, server_info: dict[str, Any] | None) -> bool:
    """Whether to ask the vLLM bootstrap server for the engine id (real vLLM has no /server_info)."""
    if plan.family != "vllm" or plan.role is not Role.PREFILL or not plan.bootstrap_port:
        return False
    desc = (server_info or {}).get("disaggregation")
    return not (isinstance(desc, dict) and _text(desc.get("engine_id")))


def bootstrap_query_url(plan: PdPlan, local_host: str) -> str:
    """Where the agent (on the engine's host) asks the bootstrap server (vLLM binds 0.0.0.0)."""
    host = plan.bootstrap_host or local_host
    return f"http://{url_host(host)}:{plan.bootstrap_port}/query"


def query_engine_id(data: Any, dp: int) -> str | None:
    """The base engine id from a bootstrap ``/query`` answer (rank 0's, without its ``_dp0``)."""
    if not isinstance(data, dict):
        return None
    entry = data.get("0")
    engine_id = _text(entry.get("engine_id")) if isinstance(entry, dict) else None
    if engine_id is None:
        return None
    if (dp > 1 or len(data) > 1) and engine_id.endswith("_dp0"):
        engine_id = engine_id[: -len("_dp0")]
    return engine_id


def _params(role: Role, protocol: str | None, plan: PdPlan, advertise_host: str, port: int | None,
            engine_id: str | None) -> PdParams | None:
    if role is Role.AGGREGATED or protocol is None:
        return None
    if role is Role.DECODE:
        return PdParams(protocol=protocol, engine_id=engine_id)
    return PdParams(protocol=protocol, bootstrap_host=plan.bootstrap_host or advertise_host,
                    bootstrap_port=port, engine_id=engine_id)


def _positive(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _port(value: Any) -> int | None:
    port = _positive(value)
    return port if port is not None and port <= 65535 else None


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None
