"""RDMA rules of the recipes for prefill/decode legs: the ROCm RDMA environment and the PD launch
preflight. Pure: the host comes in as ``HostFacts``.

Where each environment name comes from (read in the engines' and Mooncake's source):
- ``MC_GID_INDEX``: Mooncake transfer engine's RDMA config (``mooncake-transfer-engine`` config,
  default 3); the RoCE v2 IPv4 GID of AMD's RDMA NICs sits at index 1.
- ``MC_DISABLE_HIP_TRANSPORT``: Mooncake's ROCm builds install a HIP (IPC) transport for
  intra-node GPU peers unless it is ``1``; across PD instances that IPC fails on ROCm, so RDMA is
  used instead.
- ``SGLANG_HOST_IP``: SGLang's local-IP helper (``get_ip`` / ``get_local_ip_auto`` in
  ``sglang.srt.utils``) reads it first, then ``HOST_IP``; the disaggregation bootstrap and the
  Mooncake session address use it.
- ``VLLM_HOST_IP``: ``vllm/envs.py``; vLLM's ``get_ip`` and its MooncakeConnector use it.
- ``MC_TCP_BIND_ADDRESS``: Mooncake transfer engine (``transfer_engine_impl.cpp``): the address its
  RPC/handshake endpoint registers; otherwise the first local address it finds.
- ``MC_FORCE_TCP``: Mooncake installs its TCP transport instead of RDMA (SGLang's ``mooncake_tcp``
  backend sets it).
- vLLM MooncakeConnector: ``kv_connector_extra_config.mooncake_protocol`` (default ``rdma``) and
  ``device_name`` (an RDMA device whitelist); SGLang: ``--disaggregation-ib-device`` (a
  comma-separated list, or a JSON object GPU -> devices) and ``--disaggregation-transfer-backend``
  (mooncake, nixl and mori move KV over RDMA; mooncake_tcp, fake and ascend do not here).
"""

from __future__ import annotations

import ipaddress
import json

from infera_common.host.rdma import RdmaPort
from infera_worker_agent.engine_cmd import flag_value
from infera_worker_agent.host_probe import HostFacts
from infera_worker_agent.pd_role import kv_transfer_config
from infera_worker_agent.recipe_cache import BACKEND_FLAG, transfer_backend
from infera_worker_agent.recipe_types import NOTHING, RecipeContext, RecipeRefusal, RuleResult

GID_INDEX_ENV = "MC_GID_INDEX"
ROCM_GID_INDEX = "1"
HIP_TRANSPORT_ENV = "MC_DISABLE_HIP_TRANSPORT"
MOONCAKE_BIND_ENV = "MC_TCP_BIND_ADDRESS"
FORCE_TCP_ENV = "MC_FORCE_TCP"
HOST_IP_ENVS = {"sglang": "SGLANG_HOST_IP", "vllm": "VLLM_HOST_IP"}
SGLANG_HOST_IP_FALLBACK = "HOST_IP"  # SGLang reads it when SGLANG_HOST_IP is empty
IB_DEVICE_FLAG = "--disaggregation-ib-device"
RDMA_BACKENDS = ("mooncake", "nixl", "mori")
BOOTSTRAP_TIMEOUT_HINT = "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT=1800"
NON_ROUTABLE = {"", "localhost", "localhost.localdomain", "*", "0.0.0.0", "::", "127.0.0.1", "::1"}


# --- facts derived from the flags and the host --------------------------------------------------
def routable(host: str) -> bool:
    """Whether a peer on another node could reach ``host`` (a loopback or wildcard address cannot)."""
    text = host.strip().strip("[]").lower()
    if text in NON_ROUTABLE:
        return False
    try:
        addr = ipaddress.ip_address(text)
    except ValueError:
        return True  # a host name: what it resolves to is the operator's business
    return not (addr.is_loopback or addr.is_unspecified)


def rdma_devices(ctx: RecipeContext) -> tuple[str, ...] | None:
    """The RDMA devices the transfer is told to use; None = any (or not knowable from the flags)."""
    if ctx.engine == "vllm":
        extra = (_vllm_config(ctx).get("kv_connector_extra_config") or {})
        names = extra.get("device_name") if isinstance(extra, dict) else None
        return _split(names) if isinstance(names, str) and names.strip() else None
    value = flag_value(ctx.args, IB_DEVICE_FLAG)
    if value is None or not value.strip():
        return None
    if value.strip().startswith("{"):  # {"0": "mlx5_0", "1": "mlx5_1,mlx5_2", ...}
        try:
            mapping = json.loads(value)
        except ValueError:
            return None
        if not isinstance(mapping, dict):
            return None
        return tuple(dict.fromkeys(d for v in mapping.values() if isinstance(v, str) for d in _split(v)))
    if value.strip().endswith(".json"):
        return None  # a file the engine reads: not the agent's to open here
    return _split(value)


def rail_address(host: HostFacts, gid_index: int, devices: tuple[str, ...] | None) -> RdmaPort | None:
    """The first active RoCE port (among ``devices`` when given) with an IPv4 GID; its address is
    the GID at ``gid_index`` when that is IPv4, else the port's first IPv4 GID."""
    for port in host.active_ports:
        if devices is not None and port.device not in devices:
            continue
        if port.link_layer is not None and port.link_layer.lower() != "ethernet":
            continue  # InfiniBand GIDs are not IP addresses
        if port.ipv4_gid(gid_index) or any(port.ipv4_gid(i) for i in range(len(port.gids))):
            return port
    return None


def port_address(port: RdmaPort, gid_index: int) -> str:
    return port.ipv4_gid(gid_index) or next(a for i in range(len(port.gids)) if (a := port.ipv4_gid(i)))


# --- the ROCm RDMA environment -----------------------------------------------------------------
def rocm_rdma_env_rule(ctx: RecipeContext) -> RuleResult:
    """On a ROCm host, for a PD leg: Mooncake's GID index and HIP-transport switch, and the KV-transfer
    host IP pinned to the RDMA rail (the first active port's RoCE GID, else the advertise host) under
    the engine's and Mooncake's names. Only variables that are unset (or empty) are set."""
    if not ctx.pd_leg or not ctx.host.rocm:
        return NOTHING
    env = ctx.env
    changes: list[tuple[str, str]] = []
    if not env.get(GID_INDEX_ENV):
        changes.append((GID_INDEX_ENV, ROCM_GID_INDEX))
    if not env.get(HIP_TRANSPORT_ENV):
        changes.append((HIP_TRANSPORT_ENV, "1"))
    gid_text = env.get(GID_INDEX_ENV) or ROCM_GID_INDEX
    gid_index = int(gid_text) if gid_text.strip().isdigit() else int(ROCM_GID_INDEX)

    notes = []
    port = rail_address(ctx.host, gid_index, rdma_devices(ctx))
    if port is not None:
        address, source = port_address(port, gid_index), f"the RoCE GID of {port.name}"
    elif _ip_literal(ctx.advertise_host) and routable(ctx.advertise_host):
        address, source = ctx.advertise_host.strip("[]"), "--advertise-host (no active RoCE port with an IPv4 GID)"
    else:
        address, source = None, ""
        notes.append("ROCm RDMA env: KV-transfer host IP not pinned: no active RoCE port with an IPv4 GID and no "
                     "routable --advertise-host IP address")
    if address is not None:
        engine_var = HOST_IP_ENVS[ctx.engine]
        taken = env.get(engine_var) or (ctx.engine == "sglang" and env.get(SGLANG_HOST_IP_FALLBACK))
        pinned = [name for name, is_set in ((engine_var, taken), (MOONCAKE_BIND_ENV, env.get(MOONCAKE_BIND_ENV)))
                  if not is_set]
        changes += [(name, address) for name in pinned]
        if pinned:
            notes.append(f"ROCm RDMA env: KV-transfer host IP {address} from {source}")
    if changes:
        notes.insert(0, "ROCm RDMA env: set " + ", ".join(f"{k}={v}" for k, v in changes) + " (only unset variables)")
    return RuleResult(env=tuple(changes), notes=tuple(notes))


# --- the PD launch preflight -------------------------------------------------------------------
def pd_preflight_rule(ctx: RecipeContext) -> RuleResult:
    """A PD leg must advertise a routable host and move its KV over RDMA on active RDMA ports;
    otherwise refuse, naming each problem and its fix, unless ``--disaggregation-allow-tcp``."""
    if not ctx.pd_leg:
        return NOTHING
    problems = []
    if not routable(ctx.advertise_host):
        problems.append(
            f"it would advertise {ctx.advertise_host or '(nothing)'}, which a peer on another node cannot reach (the "
            "bootstrap and the KV transfer connect to it); fix: --advertise-host <this node's routable IP>")
    transport = _transport_problem(ctx)
    if transport is not None:
        problems.append(transport)
    else:
        problems += _port_problems(ctx)
    if not problems:
        return RuleResult(notes=("PD preflight: routable advertise host, RDMA transfer on active RDMA ports",))
    if ctx.allow_tcp:
        return RuleResult(notes=tuple(f"PD preflight skipped (--disaggregation-allow-tcp): {p}" for p in problems))
    lines = [f"refusing to start this {ctx.engine} {ctx.role.value} worker: its KV transfer would not run over "
             "RDMA between nodes:"]
    lines += [f"  - {p}" for p in problems]
    lines.append("For a single-host or TCP-only test, pass --disaggregation-allow-tcp.")
    if ctx.engine == "sglang":
        lines.append("For a cold cross-node bootstrap (a first start, while the peer still loads its weights), "
                     f"also export {BOOTSTRAP_TIMEOUT_HINT}.")
    raise RecipeRefusal("\n".join(lines))


def _transport_problem(ctx: RecipeContext) -> str | None:
    force_tcp = ctx.env.get(FORCE_TCP_ENV, "").strip().lower()
    if ctx.engine == "sglang":
        backend = transfer_backend(ctx.args)
        if backend not in RDMA_BACKENDS:
            return (f"{BACKEND_FLAG} {backend} does not move KV over RDMA; fix: {BACKEND_FLAG} mooncake "
                    "(or nixl, mori)")
        uses_mooncake = backend == "mooncake"
    else:
        extra = _vllm_config(ctx).get("kv_connector_extra_config") or {}
        protocol = str(extra.get("mooncake_protocol", "rdma")) if isinstance(extra, dict) else "rdma"
        if protocol.lower() != "rdma":
            return (f"--kv-transfer-config kv_connector_extra_config.mooncake_protocol is {protocol!r}, not rdma; "
                    "fix: drop mooncake_protocol (default rdma) or set it to \"rdma\"")
        uses_mooncake = True
    if uses_mooncake and force_tcp not in ("", "0", "false", "no", "off"):
        return f"{FORCE_TCP_ENV}={ctx.env[FORCE_TCP_ENV]} forces Mooncake onto TCP; fix: unset {FORCE_TCP_ENV}"
    return None


def _port_problems(ctx: RecipeContext) -> list[str]:
    ports = ctx.host.rdma_ports
    if not ports:
        return ["this host has no RDMA device (/sys/class/infiniband is empty); fix: run on a node with RDMA NICs "
                "and their drivers (in a container, pass /dev/infiniband through and use the host network)"]
    active = ctx.host.active_ports
    if not active:
        states = ", ".join(f"{p.name} down" for p in ports)
        return [f"no RDMA port is active ({states}); fix: bring the RDMA links up (ibv_devinfo shows PORT_ACTIVE)"]
    wanted = rdma_devices(ctx)
    if wanted is None:
        return []
    up = {p.device for p in active}
    missing = [d for d in wanted if d not in up]
    if not missing:
        return []
    flag = IB_DEVICE_FLAG if ctx.engine == "sglang" else "kv_connector_extra_config.device_name"
    return [f"{flag} names {', '.join(missing)}, which has no active port here (active: "
            f"{', '.join(sorted(up))}); fix: name active devices"]


def _vllm_config(ctx: RecipeContext) -> dict:
    return kv_transfer_config(ctx.args, dotted=True) or {}


def _split(text: str) -> tuple[str, ...]:
    return tuple(d.strip() for d in text.split(",") if d.strip())


def _ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip().strip("[]"))
    except ValueError:
        return False
    return True
