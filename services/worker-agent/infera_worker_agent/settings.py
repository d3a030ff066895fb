"""The worker-agent's settings: one pydantic field = one ``--flag`` + one ``INFERA_*`` env var.

Every argument the agent does not declare here is the engine's, passed on verbatim and in order;
so are all arguments after a literal ``--`` (the way to hand the engine a flag whose name the agent
also uses, e.g. ``-- --log-level debug``). The engine owns ``--host``, ``--port``, ``--model-path``
/ ``--model`` and ``--served-model-name``: the agent reads them but never declares them.
"""

from __future__ import annotations

import ipaddress
import re
import secrets
from typing import ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from infera_common.settings import (
    DrainSettings, KvReplaySettings, LogSettings, MetricsSettings, PlaneSettings, build_parser, parse_cli,
)
from infera_common.subjects import TOKEN_RE
from infera_common.typos import near_misses

PROG = "infera-worker-agent"
#: a DNS host name (labels of letters, digits, '-', and '_' as some clusters use), optionally fully qualified
_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
HOST_NAME_RE = re.compile(rf"{_LABEL}(?:\.{_LABEL})*\.?")
DESCRIPTION = (
    "Launch one inference engine (mock, sglang or vllm), register it in discovery, and relay its requests "
    "from NATS (--request-transport nats) or let routers call it directly (http). Unrecognised arguments, "
    "and everything after `--`, go to the engine."
)


class AgentSettings(DrainSettings, PlaneSettings, LogSettings, MetricsSettings, KvReplaySettings):
    metrics_service: ClassVar[str] = "worker-agent"

    engine: Literal["mock", "sglang", "vllm"] = Field(
        description="Engine to launch: the mock engine, SGLang (sglang.launch_server) or vLLM "
        "(vllm.entrypoints.launchers.api_server.entry where the installed vLLM has it, as from 0.32; "
        "else vllm.entrypoints.openai.api_server)."
    )
    engine_python: str | None = Field(
        None,
        description="Python interpreter that runs the engine (`PYTHON -m <engine module>`), e.g. a separate venv "
        "holding vLLM or SGLang (.venv-vllm/bin/python); default: the agent's own interpreter. Asked at start, "
        "in a short subprocess, whether it has the engine (refused if not) and which SGLang version the "
        "recipe rules check.",
    )
    worker_id: str | None = Field(
        None,
        pattern=TOKEN_RE.pattern,
        description="Worker id in discovery and in subject names (letters, digits, '_', '-'); "
        "default <engine>-<8 random hex digits>.",
    )
    advertise_host: str | None = Field(
        None,
        description="Host the fleet uses to reach the engine (registered URL http://HOST:PORT); "
        "default: the engine's --host when it names one address, else 127.0.0.1.",
    )
    role: Literal["aggregated", "prefill", "decode"] | None = Field(
        None,
        description="Serving role recorded in discovery. Default: read from the engine's flags (SGLang "
        "--disaggregation-mode, vLLM --kv-transfer-config kv_role). When given it must agree with them; it "
        "picks the role of a vLLM kv_both engine (registered aggregated otherwise).",
    )
    max_pending: int = Field(
        512, ge=1, le=1_000_000,
        description="Requests this worker may hold unfinished (queued + running): with --request-transport nats "
        "the broker refuses more; with http the routers keep the worker's in-flight requests under it.",
    )
    request_max_age: float = Field(
        600.0, gt=0,
        description="Seconds a request may stay in this worker's queue before the broker discards it "
        "(--request-transport nats).",
    )
    health_timeout: float = Field(
        1800.0, gt=0, description="Seconds to wait for the engine to become healthy before giving up."
    )
    health_check_interval: float = Field(
        10.0, ge=0,
        description="While serving, seconds between probes of the engine's /health (0: no probes). After "
        "--health-check-failures failed probes in a row the worker is registered 'unhealthy' (routers send it "
        "nothing new; requests with nothing answered yet are handed back to be retried elsewhere, streams "
        "under way go on) until a probe passes again.",
    )
    health_check_timeout: float = Field(
        30.0, gt=0,
        description="Seconds one serving-time health probe may take before it counts as failed (SGLang's /health "
        "runs a one-token generation and answers 503 itself after SGLANG_HEALTH_CHECK_TIMEOUT, 20 s by default).",
    )
    health_check_failures: int = Field(
        3, ge=1, description="Failed health probes in a row that make the worker 'unhealthy'."
    )
    engine_stall_check: bool = Field(
        True,
        description="While serving, when the engine held requests through a whole --health-check-interval and its "
        "token counters (/metrics) did not move, send it a one-token completion; if neither that nor any other "
        "request makes progress within --health-check-timeout, register the worker 'unhealthy' at once. vLLM's "
        "/health only reports a dead engine core, so a hung GPU or collective passes it. SGLang prefill and "
        "decode workers are not tested this way (a completion there needs its pair; their generating /health "
        "tests them); vLLM's are (a completion without kv_transfer_params runs as an ordinary one). "
        "--no-engine-stall-check turns it off.",
    )
    engine_idle_canary_after: float = Field(
        10.0, ge=0,
        description="With the stall check on: when the engine has held no request and counted no token for this "
        "many seconds, the next health round sends it the one-token completion too, so that a GPU that hung while "
        "idle is found before a request meets it (Dynamo's DYN_CANARY_WAIT_TIME does the same; 0: only engines "
        "that hold work are tested). Costs an idle engine one one-token request per this many seconds. Not sent to an "
        "engine whose /health generates itself (SGLang's, unless SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION is false).",
    )
    engine_stop_timeout: float = Field(
        10.0, ge=0, description="Seconds between SIGTERM and SIGKILL when stopping the engine's process group."
    )
    load_interval: float = Field(
        1.0, gt=0, le=60, description="Seconds between load reports (engine /metrics scrape + publish)."
    )
    models_interval: float = Field(
        10.0, ge=0, description="Seconds between reads of the engine's /v1/models while serving: LoRA adapters "
        "loaded or unloaded at run time (vLLM's /v1/load_lora_adapter, SGLang's /load_lora_adapter) join or leave "
        "the worker's record, and requests naming them are routed here or no longer. 0 = read once, at start.",
    )
    enable_kv_events: bool = Field(
        True,
        description="Turn on the engine's ZMQ KV events (--kv-events-config on free ports, one per DP rank) "
        "and relay them (--kv-event-transport nats) or advertise them to the kv-indexer (zmq); --no-enable-kv-events turns them off: SWA models such as DeepSeek-V4 need it off. "
        "A --kv-events-config given to the engine is always kept as is.",
    )
    kv_index_block_size: int = Field(
        0, ge=0, le=1_048_576,
        description="Tokens per KV index block: the engine's pages (SGLang --page-size, vLLM --block-size) are "
        "folded into blocks of this many tokens, which the router hashes and the kv-indexer keeps; a multiple of "
        "the page size. 0 (default): the page size when it is 16 or more, else 16 (SGLang's default page of 1 "
        "would otherwise cost one relayed hash, index entry and router hash per token). Routing then matches "
        "prefixes to within this many tokens.",
    )
    disaggregation_allow_tcp: bool = Field(
        False,
        description="Let a prefill/decode worker start although its KV transfer would not run over RDMA between "
        "nodes (a loopback advertise host, a TCP transfer backend, no active RDMA port): for single-host or "
        "TCP-only tests. Without it such a --engine sglang|vllm PD worker is refused before launch, naming the "
        "problem and the fix (the mock engine's transfer is always TCP and never refused).",
    )
    print_command: bool = Field(
        False,
        description="Print the engine command line and the environment changes the agent would make (with notes "
        "on each recipe rule), then exit 0 without launching anything or connecting to anything.",
    )

    @field_validator("advertise_host")
    @classmethod
    def _a_host(cls, value: str | None) -> str | None:
        # registered as http://HOST:PORT: anything else gives every router a URL it cannot call
        if value is None:
            return value
        try:
            ipaddress.ip_address(value.removeprefix("[").removesuffix("]"))
            return value
        except ValueError:
            pass
        if not HOST_NAME_RE.fullmatch(value):
            raise ValueError("a host name or IP address alone, without scheme, port or path (the registered URL "
                             "is http://HOST:PORT, the port from the engine's --port)")
        return value

    @model_validator(mode="after")
    def _default_worker_id(self) -> "AgentSettings":
        if self.worker_id is None:
            self.worker_id = f"{self.engine}-{secrets.token_hex(4)}"
        return self


def split_engine_tail(argv: list[str]) -> tuple[list[str], list[str]]:
    """Split at the first literal ``--``: what follows belongs to the engine untouched."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def parse_agent_cli(argv: list[str]) -> tuple[AgentSettings, list[str]]:
    """Parse the agent's own flags; returns the settings and the engine's arguments, in order. An
    engine argument that looks like a mistyped agent flag (``infera_common.typos``) exits 2, as a bad value does."""
    own, tail = split_engine_tail(argv)
    settings, unknown = parse_cli(AgentSettings, own, prog=PROG, description=DESCRIPTION, allow_unknown=True)
    problems = near_misses(unknown, agent_flags())
    if problems:
        build_parser(AgentSettings, PROG, DESCRIPTION).error("; ".join(problems))
    return settings, unknown + tail


def agent_flags() -> list[str]:
    """Every ``--flag`` the agent declares (``--no-x`` forms included)."""
    parser = build_parser(AgentSettings, PROG, DESCRIPTION)
    return [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
