"""The engine's serving role and prefill/decode parameters, read from its command line. Pure.

The engine's own flags say what it is; the agent reads them (never changes them) and registers
the role. ``--engine mock`` follows the rules of the engine its ``--engine-flavor`` imitates
(default sglang).

SGLang (``--engine sglang``, mock flavour sglang):
- ``--disaggregation-mode prefill|decode|null``; absent or ``null`` = aggregated. Protocol
  ``sglang-bootstrap``.
- a prefill's bootstrap server listens on ``--disaggregation-bootstrap-port`` (default 8998); its
  host is the agent's advertise host. A decode has no bootstrap server.
- ``--kv-transfer-config`` is vLLM's flag: refused, naming SGLang's.

vLLM (``--engine vllm``, mock flavour vllm):
- ``--kv-transfer-config '{"kv_connector": "MooncakeConnector", "kv_role": ...}'`` (vLLM's dotted
  form ``--kv-transfer-config.kv_role kv_producer`` too, for ``--engine vllm``): ``kv_producer``
  = prefill, ``kv_consumer`` = decode. ``kv_both`` registers as aggregated: vLLM then runs both
  the producer and the consumer side and acts per request (a request without
  ``kv_transfer_params`` is served whole), so the agent's ``--role prefill|decode`` may pick a
  PD role for it. Protocol ``vllm-mooncake``.
- the bootstrap port is vLLM's ``VLLM_MOONCAKE_BOOTSTRAP_PORT`` (default 8998) in the engine's
  environment, or the ``kv_connector_extra_config.bootstrap_server_address`` ``host:port`` of an
  external bootstrap server; the engine id is the config's ``engine_id`` (vLLM generates one when
  absent; the agent then asks the running engine, see ``pd_report``).
- a connector other than MooncakeConnector (NIXL, LMCache, offloading, ...) is served as
  aggregated: Infera pairs vLLM prefill/decode over Mooncake only; a note says so.
- kv_role missing with a connector, or not one of the three, is refused (vLLM refuses it too);
  SGLang's ``--disaggregation-*`` flags are refused, naming vLLM's.

Both: an unparseable value is refused; a prefill bootstrap port must be 1-65535 (0, "any free
port", only for the mock, which reports the port it bound). The agent's ``--role``, when given,
must agree with the engine's flags (or pick a role for vLLM ``kv_both``); otherwise the message
says which engine flag to add or drop. DP size: SGLang ``--dp-size`` / ``--data-parallel-size`` /
``--dp`` (with or without ``--enable-dp-attention``), vLLM ``--data-parallel-size`` / ``-dp``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from infera_common.schemas import Role
from infera_worker_agent.engine_cmd import EngineArgsError, flag_value, has_flag
from infera_worker_agent.kv_config import dp_size, parse_json_flag

Family = Literal["sglang", "vllm"]
PROTOCOLS: dict[str, str] = {"sglang": "sglang-bootstrap", "vllm": "vllm-mooncake"}
SGLANG_MODES = {"null": Role.AGGREGATED, "prefill": Role.PREFILL, "decode": Role.DECODE}
KV_ROLES = {"kv_producer": Role.PREFILL, "kv_consumer": Role.DECODE, "kv_both": Role.AGGREGATED}
MOONCAKE_CONNECTOR = "MooncakeConnector"
DEFAULT_BOOTSTRAP_PORT = 8998
BOOTSTRAP_PORT_ENV = "VLLM_MOONCAKE_BOOTSTRAP_PORT"
MODE_FLAG = "--disaggregation-mode"
PORT_FLAG = "--disaggregation-bootstrap-port"
SGLANG_PD_FLAGS = (MODE_FLAG, PORT_FLAG, "--disaggregation-transfer-backend")
KV_TRANSFER_FLAG = "--kv-transfer-config"
FLAVOR_FLAGS = ("--engine-flavor", "--engine-flavour")
HOW_TO = {
    ("sglang", Role.PREFILL): f"{MODE_FLAG} prefill",
    ("sglang", Role.DECODE): f"{MODE_FLAG} decode",
    ("vllm", Role.PREFILL): f"""{KV_TRANSFER_FLAG} '{{"kv_connector":"{MOONCAKE_CONNECTOR}","kv_role":"kv_producer"}}'""",
    ("vllm", Role.DECODE): f"""{KV_TRANSFER_FLAG} '{{"kv_connector":"{MOONCAKE_CONNECTOR}","kv_role":"kv_consumer"}}'""",
}


@dataclass(frozen=True, slots=True)
class PdPlan:
    """What the engine's flags say about its role, before it runs."""

    family: Family  # whose flags and protocol: SGLang's or vLLM's
    role: Role
    dp_size: int = 1
    protocol: str | None = None  # set when the engine can take part in a PD transfer
    bootstrap_port: int | None = None  # a prefill's bootstrap server (0: the mock picks one and reports it)
    bootstrap_host: str | None = None  # an external bootstrap server (vLLM); None = the advertise host
    engine_id: str | None = None  # vLLM, as configured; None = the engine generates one
    either: bool = False  # vLLM kv_both: the engine can act as prefill or decode per request
    source: str = ""  # the engine flag the role comes from, for messages
    notes: tuple[str, ...] = ()  # worth a warning at start (e.g. a connector Infera does not pair)


def engine_family(engine: str, args: Sequence[str]) -> Family:
    if engine == "mock":
        return "vllm" if flag_value(args, *FLAVOR_FLAGS) == "vllm" else "sglang"
    return "vllm" if engine == "vllm" else "sglang"


def plan_pd(engine: str, args: Sequence[str], *, env: Mapping[str, str], role: str | None = None) -> PdPlan:
    """The role and PD parameters the engine's flags give; ``role`` is the agent's ``--role``.

    ``args`` are the engine's arguments as its parser reads them (``engine_cmd.vllm_flag_view``
    for vLLM); ``env`` the environment the engine gets. Raises EngineArgsError naming what to change.
    """
    family = engine_family(engine, args)
    dp = dp_size(engine, args)
    plan = _sglang(engine, args, dp) if family == "sglang" else _vllm(engine, args, env, dp)
    return apply_role(plan, role)


# --- SGLang ---------------------------------------------------------------------------------------
def _sglang(engine: str, args: Sequence[str], dp: int) -> PdPlan:
    if has_flag(args, KV_TRANSFER_FLAG):
        raise EngineArgsError(
            f"{KV_TRANSFER_FLAG} is vLLM's flag; SGLang takes {MODE_FLAG} prefill|decode "
            f"(and {PORT_FLAG} P on the prefill)"
        )
    mode = _value(args, MODE_FLAG) or "null"
    if mode not in SGLANG_MODES:
        raise EngineArgsError(f"{MODE_FLAG} {mode!r} is not one of {', '.join(SGLANG_MODES)} "
                              "(null = aggregated)")
    port_text = _value(args, PORT_FLAG)
    port = DEFAULT_BOOTSTRAP_PORT if port_text is None else _int(port_text, PORT_FLAG)
    role = SGLANG_MODES[mode]
    if role is Role.AGGREGATED:
        return PdPlan("sglang", role, dp)
    if role is Role.PREFILL:
        _check_bootstrap_port(engine, port, PORT_FLAG)
    return PdPlan("sglang", role, dp, protocol=PROTOCOLS["sglang"],
                  bootstrap_port=port if role is Role.PREFILL else None, source=f"{MODE_FLAG} {mode}")


# --- vLLM -----------------------------------------------------------------------------------------
def _vllm(engine: str, args: Sequence[str], env: Mapping[str, str], dp: int) -> PdPlan:
    for flag in SGLANG_PD_FLAGS:
        if has_flag(args, flag):
            raise EngineArgsError(
                f"{flag} is SGLang's flag; vLLM takes {HOW_TO['vllm', Role.PREFILL]} for a prefill "
                f"(kv_consumer for a decode), its bootstrap port from {BOOTSTRAP_PORT_ENV}"
            )
    config = kv_transfer_config(args, dotted=engine == "vllm")
    if config is None:
        return PdPlan("vllm", Role.AGGREGATED, dp)
    connector, kv_role = config.get("kv_connector"), config.get("kv_role")
    if kv_role is not None and kv_role not in KV_ROLES:
        raise EngineArgsError(f"{KV_TRANSFER_FLAG}: kv_role {kv_role!r} is not one of {', '.join(KV_ROLES)}")
    if connector is not None and kv_role is None:
        raise EngineArgsError(f"{KV_TRANSFER_FLAG}: kv_connector {connector!r} needs a kv_role: kv_producer "
                              "(prefill), kv_consumer (decode) or kv_both")
    if connector is None or kv_role is None:
        return PdPlan("vllm", Role.AGGREGATED, dp)  # vLLM transfers nothing without both
    engine_id = config.get("engine_id")
    if engine_id is not None and not (isinstance(engine_id, str) and engine_id):
        raise EngineArgsError(f"{KV_TRANSFER_FLAG}: engine_id must be a non-empty string, got {engine_id!r}")
    extra = config.get("kv_connector_extra_config")
    if extra is not None and not isinstance(extra, dict):
        raise EngineArgsError(f"{KV_TRANSFER_FLAG}: kv_connector_extra_config must be a JSON object")
    if connector != MOONCAKE_CONNECTOR:
        notes = () if kv_role == "kv_both" else (
            f"{KV_TRANSFER_FLAG} kv_connector {connector!r} with kv_role {kv_role}: Infera pairs vLLM "
            f"prefill/decode over {MOONCAKE_CONNECTOR} only, so this engine is served as aggregated",)
        return PdPlan("vllm", Role.AGGREGATED, dp, notes=notes)
    host, port = None, None
    if kv_role != "kv_consumer":  # producers (and kv_both) run the bootstrap server
        address = (extra or {}).get("bootstrap_server_address")
        if address:
            host, port = split_host_port(str(address), "kv_connector_extra_config.bootstrap_server_address")
        else:
            port = env_port(env)
            _check_bootstrap_port(engine, port, BOOTSTRAP_PORT_ENV)
    return PdPlan("vllm", KV_ROLES[kv_role], dp, protocol=PROTOCOLS["vllm"], bootstrap_port=port,
                  bootstrap_host=host, engine_id=engine_id, either=kv_role == "kv_both",
                  source=f"{KV_TRANSFER_FLAG} kv_role {kv_role}")


def kv_transfer_config(args: Sequence[str], *, dotted: bool) -> dict[str, Any] | None:
    """vLLM's ``--kv-transfer-config``: the last JSON value, or (``dotted``, as vLLM's parser does)
    the object built from ``--kv-transfer-config.KEY VALUE`` pairs, which then replaces it."""
    raw = flag_value(args, KV_TRANSFER_FLAG)
    if raw is None and has_flag(args, KV_TRANSFER_FLAG):
        raise EngineArgsError(f"{KV_TRANSFER_FLAG} needs a JSON object")
    keyed = _dotted(args, KV_TRANSFER_FLAG) if dotted else {}
    if keyed:
        return keyed
    if raw is None:
        return None
    return parse_json_flag(KV_TRANSFER_FLAG, raw)


def _dotted(args: Sequence[str], flag: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    prefix = flag + "."
    for i, arg in enumerate(args):
        if not arg.startswith(prefix):
            continue
        name, eq, text = arg.partition("=")
        if not eq:
            if i + 1 >= len(args):
                raise EngineArgsError(f"{name} needs a value")
            text = args[i + 1]
        path = name[len(prefix):]
        keys = path.rstrip("+").split(".")
        value: Any
        if path.endswith("+"):  # list elements, appended
            value = text.split(",")
        else:
            try:
                value = json.loads(text)
            except ValueError:
                value = text
        node = out
        for key in keys[:-1]:
            child = node.get(key)
            if not isinstance(child, dict):
                child = node[key] = {}
            node = child
        if isinstance(value, list) and isinstance(node.get(keys[-1]), list):
            node[keys[-1]] += value
        else:
            node[keys[-1]] = value
    return out


def env_port(env: Mapping[str, str]) -> int:
    text = env.get(BOOTSTRAP_PORT_ENV) or ""
    if not text:
        return DEFAULT_BOOTSTRAP_PORT
    return _int(text, BOOTSTRAP_PORT_ENV)


def split_host_port(text: str, what: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port``, an ``http://`` prefix allowed) -> (host, port)."""
    rest = text.split("://", 1)[1] if "://" in text else text
    host, sep, port_text = rest.rstrip("/").rpartition(":")
    host = host.strip("[]")
    if not sep or not host:
        raise EngineArgsError(f"{what} {text!r} is not host:port")
    port = _int(port_text, what)
    if not 1 <= port <= 65535:
        raise EngineArgsError(f"{what} {text!r}: port {port} is out of range 1-65535")
    return host, port


# --- shared ---------------------------------------------------------------------------------------
def apply_role(plan: PdPlan, role: str | None) -> PdPlan:
    """The agent's ``--role`` against the engine's flags: agree, or pick one for vLLM kv_both."""
    if role is None or Role(role) is plan.role:
        return plan
    wanted = Role(role)
    if plan.either:
        return replace(plan, role=wanted)
    if plan.role is Role.AGGREGATED:
        raise EngineArgsError(
            f"--role {role}, but the engine's flags run it aggregated: add {HOW_TO[plan.family, wanted]} to the "
            "engine's arguments (the agent reads the role from them; --role is only needed to pick one for "
            "vLLM's kv_both)"
        )
    fix = f"drop {plan.source}" if wanted is Role.AGGREGATED else f"use {HOW_TO[plan.family, wanted]}"
    raise EngineArgsError(
        f"--role {role}, but the engine's flags make it a {plan.role.value} ({plan.source}): "
        f"{fix}, or drop --role (the agent reads the role from the engine's flags)"
    )


def _check_bootstrap_port(engine: str, port: int, what: str) -> None:
    if engine == "mock" and port == 0:
        return  # the mock binds a free port and reports it in /server_info
    if not 1 <= port <= 65535:
        hint = " (0 works only with the mock engine, which reports the port it bound)" if port == 0 else ""
        raise EngineArgsError(f"{what} {port} is out of range 1-65535{hint}: the fleet must know the "
                              "prefill's bootstrap port")


def _value(args: Sequence[str], flag: str) -> str | None:
    value = flag_value(args, flag)
    if value is None and has_flag(args, flag):
        raise EngineArgsError(f"{flag} needs a value")
    return value


def _int(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise EngineArgsError(f"{what} {text!r} is not a number") from None
