"""The engine's command line and where the engine will be reached: a pure function, no I/O.

The agent reads (never consumes) the engine arguments it needs: ``--port``, ``--host``,
``--model-path`` / ``--model`` and ``--served-model-name``. What it adds is appended at the end:
``--port P`` when no port is given, the bundled model for the mock engine when no model is
given, and ``--enable-metrics`` for SGLang (its /metrics, which the load report reads, is off by
default), and ``--kv-events-config`` for KV events unless turned off or given (``kv_config``).
The recipe rules (``recipes.apply_recipes``) then append theirs and plan the environment.
The serving role (aggregated, prefill, decode) is read from the same arguments (``pd_role``).
vLLM's flags are read the way vLLM reads them (``--a_b`` is ``--a-b``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from infera_common.engine_relay import ABORT_PATHS
from infera_common.kv_endpoints import url_host

if TYPE_CHECKING:
    from infera_worker_agent.kv_config import KvEventsPlan
    from infera_worker_agent.pd_role import PdPlan

#: ``python -m`` modules that start each engine's server, preferred first. vLLM 0.32 moved its server
#: to ``launchers.api_server.entry`` and warns that the older module, which every earlier release
#: has, is deprecated; both parse the same flags.
LAUNCH_MODULES = {
    "mock": ("infera_mock_engine",),
    "sglang": ("sglang.launch_server",),
    "vllm": ("vllm.entrypoints.launchers.api_server.entry", "vllm.entrypoints.openai.api_server"),
}


def launch_module(engine: str, present: frozenset[str] | None) -> str:
    """The first of the engine's launch modules that the interpreter has (``present``; None: not
    known), else the one every release has."""
    modules = LAUNCH_MODULES[engine]
    return next((m for m in modules if present is not None and m in present), modules[-1])


WILDCARD_HOSTS = {"", "0.0.0.0", "::", "[::]", "*"}
LOCAL_HOST = "127.0.0.1"


class EngineArgsError(ValueError):
    """The engine arguments cannot work (e.g. a port that is not a number)."""


@dataclass(frozen=True, slots=True)
class EnginePlan:
    argv: tuple[str, ...]  # full command line, interpreter first
    port: int
    bind_host: str | None  # the engine's --host, if given
    local_url: str  # how the agent itself reaches the engine
    advertise_host: str
    url: str  # registered in discovery
    model_hint: str | None  # served name or model path; the engine's /v1/models is the truth
    abort_path: str | None
    engine_args: tuple[str, ...] = ()  # the user's engine arguments (before the agent's additions)
    kv_events: "KvEventsPlan | None" = None
    pd: "PdPlan | None" = None  # role and PD parameters read from the engine's flags (pd_role)
    engine: str = ""  # mock | sglang | vllm
    env_changes: tuple[tuple[str, str], ...] = ()  # set in the engine's environment (recipes: only unset names)
    notes: tuple[str, ...] = ()  # what the recipe rules did or skipped, and why
    api_key: str | None = field(default=None, repr=False)  # the engine's --api-key (``engine_api_key``)


def flag_value(args: Sequence[str], *names: str) -> str | None:
    """Value of the last occurrence of any of ``names`` (``--x v`` or ``--x=v``), like argparse."""
    value = None
    for i, arg in enumerate(args):
        for name in names:
            if arg == name and i + 1 < len(args):
                value = args[i + 1]
            elif arg.startswith(name + "="):
                value = arg[len(name) + 1:]
    return value


def has_flag(args: Sequence[str], *names: str) -> bool:
    return any(arg in names or any(arg.startswith(n + "=") for n in names) for arg in args)


def vllm_flag_view(args: Sequence[str]) -> list[str]:
    """The arguments as vLLM's parser reads their names: ``--a_b`` is ``--a-b``.

    vLLM's FlexibleArgumentParser turns underscores into dashes in a flag's name, up to its first
    ``.`` (``--kv_transfer_config.kv_role`` is ``--kv-transfer-config.kv_role``) and before any
    ``=``. Values are untouched. Used only to read flags; the engine gets the arguments verbatim.
    """
    out = []
    for arg in args:
        if arg.startswith("--"):
            name, eq, value = arg.partition("=")
            head, dot, tail = name[2:].partition(".")
            arg = "--" + head.replace("_", "-") + dot + tail + eq + value
        out.append(arg)
    return out


def _port(value: str) -> int:
    try:
        port = int(value)
    except ValueError:
        raise EngineArgsError(f"engine --port {value!r} is not a number") from None
    if not 1 <= port <= 65535:
        raise EngineArgsError(
            f"engine --port {port} is out of range 1-65535 (omit --port to let the agent pick a free port)"
        )
    return port


def plan_engine(
    engine: str,
    engine_args: Sequence[str],
    *,
    python: str,
    free_port: int,
    default_model_path: str,
    advertise_host: str | None = None,
    enable_kv_events: bool = False,
    find_ports: Callable[[int], int] | None = None,
    role: str | None = None,
    env: Mapping[str, str] | None = None,
    present_modules: frozenset[str] | None = None,
) -> EnginePlan:
    """Build the engine command line and the URLs the agent uses and registers.

    ``free_port`` is used only when the arguments name no ``--port``; ``find_ports(n)`` (first of n
    contiguous free ports) only when KV events are turned on by the agent (``kv_config``). ``role``
    is the agent's ``--role`` (None: read from the engine's flags) and ``env`` the environment the
    engine will get (vLLM reads its Mooncake bootstrap port from it); see ``pd_role``.
    ``present_modules``: the launch modules the interpreter ``python`` has (``launch_module``).
    """
    if engine not in LAUNCH_MODULES:
        raise EngineArgsError(f"unknown engine {engine!r}; choose one of {', '.join(LAUNCH_MODULES)}")
    verbatim = list(engine_args)
    args = vllm_flag_view(verbatim) if engine == "vllm" else verbatim  # what the engine's parser reads
    extra: list[str] = []

    port_arg = flag_value(args, "--port")
    if port_arg is None:
        port = free_port
        extra += ["--port", str(port)]
    else:
        port = _port(port_arg)

    model = flag_value(args, "--model-path", "--model")
    if engine == "mock" and model is None:  # the mock also takes vLLM's `[serve] MODEL` positional
        words = args[1:] if args[:1] == ["serve"] else args
        if words and not words[0].startswith("-"):
            model = words[0]
    if engine == "mock" and model is None:
        model = default_model_path
        extra += ["--model-path", model]
    if engine == "sglang" and not has_flag(args, "--enable-metrics"):
        extra.append("--enable-metrics")
    from infera_worker_agent.kv_config import plan_kv_events  # kv_config and pd_role build on this module
    from infera_worker_agent.pd_role import plan_pd

    pd = plan_pd(engine, args, env={} if env is None else env, role=role)
    kv = plan_kv_events(engine, args, enabled=enable_kv_events and find_ports is not None,
                        find_ports=find_ports or _no_ports)
    extra += kv.extra_args

    bind_host = flag_value(args, "--host")
    reach = LOCAL_HOST if bind_host is None or bind_host in WILDCARD_HOSTS else bind_host
    if advertise_host is None:
        advertise_host = reach
    served = flag_value(args, "--served-model-name")
    return EnginePlan(
        argv=(python, "-m", launch_module(engine, present_modules), *verbatim, *extra),
        port=port,
        bind_host=bind_host,
        local_url=f"http://{url_host(reach)}:{port}",
        advertise_host=advertise_host,
        url=f"http://{url_host(advertise_host)}:{port}",
        model_hint=served or model,
        abort_path=ABORT_PATHS[engine],
        engine_args=tuple(verbatim),
        kv_events=kv,
        pd=pd,
        engine=engine,
        api_key=engine_api_key(engine, verbatim, {} if env is None else env),
    )


def engine_api_key(engine: str, engine_args: Sequence[str], env: Mapping[str, str]) -> str | None:
    """The API key the engine will ask every request for, or None.

    SGLang's and vLLM's ``--api-key`` (vLLM also ``VLLM_API_KEY`` in its environment; the mock as the
    engine of its ``--engine-flavor``) make the engine answer 401 to every request without
    ``Authorization: Bearer <key>``: the worker-agent sends it on each of its calls to the engine,
    and a router that calls the engine itself (``--request-transport http``) needs it as its
    ``--engine-api-key``."""
    args = vllm_flag_view(engine_args) if engine == "vllm" else engine_args
    key = flag_value(args, "--api-key")
    if key is not None:
        return key
    flavor = engine
    if engine == "mock":
        flavor = flag_value(engine_args, "--engine-flavor", "--engine-flavour") or "sglang"
    return env.get("VLLM_API_KEY") or None if flavor == "vllm" else None


def redacted(argv: Sequence[str]) -> list[str]:
    """The command line as it may be logged: an ``--api-key``'s value hidden (``--api_key`` too)."""
    out, hide = [], False
    for arg in argv:
        name, eq, _ = arg.partition("=")
        secret = name.replace("_", "-") == "--api-key"
        out.append("***" if hide else (name + "=***" if secret and eq else arg))
        hide = secret and not eq
    return out


def stats_problem(engine: str, engine_args: Sequence[str]) -> str | None:
    """Why a vLLM started with ``--disable-log-stats`` cannot serve behind Infera, or None.

    The flag removes vLLM's stat loggers, the Prometheus one included: its ``/metrics`` then has no
    ``vllm:`` series at all (checked on vLLM 0.32.0). The worker-agent reads them for its load
    reports (running and waiting requests, KV usage, which every routing policy weighs) and for
    the stall check's token counters, so the worker would route blind and a hung GPU behind it
    would go unnoticed. Runbooks use the flag to quiet vLLM's periodic stats log line, which
    ``VLLM_LOGGING_LEVEL=WARNING`` also does while keeping the metrics."""
    if engine != "vllm" or not has_flag(vllm_flag_view(engine_args), "--disable-log-stats"):
        return None
    return ("the engine argument --disable-log-stats turns off vLLM's Prometheus metrics, which the worker-agent reads "
            "for load reports (routing) and hang detection. Remove it; to quiet vLLM's periodic stats log line set "
            "VLLM_LOGGING_LEVEL=WARNING in the engine's environment instead")


#: SGLang's switch for the generation its /health runs (``envs.SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION``)
HEALTH_GENERATION_ENV = "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"


def health_generates(engine: str, engine_args: Sequence[str], env: Mapping[str, str]) -> bool:
    """Whether the engine's own /health runs a one-token generation on every probe, as SGLang's does
    (its ``EnvBool`` reads ``false``/``0``/``no``/``n`` as off; default on), so that an idle engine
    needs no canary of the agent's: a hang already fails its health probes. vLLM's /health only
    says whether its engine core process lives. The mock follows its ``--engine-flavor``."""
    flavor = engine
    if engine == "mock":
        flavor = flag_value(engine_args, "--engine-flavor", "--engine-flavour") or "sglang"
    if flavor != "sglang":
        return False
    return env.get(HEALTH_GENERATION_ENV, "true").strip().lower() not in ("false", "0", "no", "n")


def launch_problems(engine: str, engine_args: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """Engine arguments that would leave the engine unusable behind Infera (refused before launch)."""
    return [p for p in (stats_problem(engine, engine_args),) if p is not None]


def _no_ports(n: int) -> int:
    raise EngineArgsError("no port finder given for the KV events endpoints")
