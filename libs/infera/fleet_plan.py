"""The default local fleet as data: which processes `infera up` starts, with which arguments.

Pure: no I/O. `compose.yaml` describes the same topology for containers, and a test checks that
the two agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from infera_common.models import BUNDLED_MODEL_NAME
from infera_common.settings import nats_planes
from infera_worker_agent.pd_role import BOOTSTRAP_PORT_ENV


@dataclass(frozen=True)
class ProcSpec:
    name: str  # e.g. "router", "frontend", "worker-1"
    role: str  # "router" | "frontend" | "worker"
    module: str  # python -m target
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # set on top of the launcher's environment

    def argv(self, python: str) -> list[str]:
        return [python, "-m", self.module, *self.args]


def default_engine_args() -> list[str]:
    """Mock-engine arguments of the default fleet (the agent adds the bundled --model-path)."""
    return ["--served-model-name", BUNDLED_MODEL_NAME]


#: The mock engine flags of a prefill and of a decode worker, per PD protocol (each engine's own).
PD_ARGS: dict[str, tuple[list[str], list[str]]] = {
    "sglang-bootstrap": (["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", "0"],
                         ["--disaggregation-mode", "decode"]),
    "vllm-mooncake": (["--engine-flavor", "vllm", "--kv-transfer-config",
                       '{"kv_connector": "MooncakeConnector", "kv_role": "kv_producer"}'],
                      ["--engine-flavor", "vllm", "--kv-transfer-config",
                       '{"kv_connector": "MooncakeConnector", "kv_role": "kv_consumer"}']),
}


def no_broker(etcd_endpoint: str | None, request_transport: str, kv_event_transport: str) -> bool:
    """True when no plane goes over NATS: discovery in etcd, requests over HTTP, KV events from ZMQ."""
    return not nats_planes("etcd" if etcd_endpoint else "nats", request_transport, kv_event_transport)


def plan_fleet(
    *,
    nats_url: str,
    host: str,
    port: int,
    workers: int,
    router_policy: str | None,
    engine_args: list[str],
    metrics_ports: list[int],
    log_format: str = "json",
    prefill_workers: int = 0,
    decode_workers: int = 0,
    pd_protocol: str = "sglang-bootstrap",
    etcd_endpoint: str | None = None,
    request_transport: str = "nats",
    kv_event_transport: str = "nats",
    otlp_traces_endpoint: str | None = None,
) -> list[ProcSpec]:
    """kv-indexer, router, frontend, ``workers`` aggregated mock worker-agents and
    ``prefill_workers`` + ``decode_workers`` disaggregated ones (SGLang bootstrap protocol), all on
    the NATS plane; with ``etcd_endpoint`` every one of them discovers the fleet in that etcd
    instead, and the transports (and ``otlp_traces_endpoint``, when given) are passed to every
    process. On the no-broker plane (etcd, http, zmq: ``no_broker``) the kv-indexer, router and
    frontend are one ``infera.server`` and nothing is given a NATS URL.

    ``metrics_ports`` holds one free port per kv-indexer, router and worker-agent, in that order
    (the frontend serves /metrics on its own HTTP port).
    """
    if workers + prefill_workers + decode_workers < 1:
        raise ValueError("the fleet needs at least one worker: --workers, or --prefill-workers and --decode-workers")
    if bool(prefill_workers) != bool(decode_workers):
        raise ValueError("disaggregated serving needs both pools: give --prefill-workers and --decode-workers together")
    if len(metrics_ports) < workers + prefill_workers + decode_workers + 2:
        raise ValueError("need one metrics port for the kv-indexer, the router and each worker")
    broker_free = no_broker(etcd_endpoint, request_transport, kv_event_transport)
    common = ([] if broker_free else ["--nats-url", nats_url]) + ["--log-format", log_format]
    if etcd_endpoint:
        common += ["--discovery-backend", "etcd", "--etcd-endpoint", etcd_endpoint]
    common += ["--request-transport", request_transport, "--kv-event-transport", kv_event_transport]
    if otlp_traces_endpoint:
        common += ["--otlp-traces-endpoint", otlp_traces_endpoint]
    policy = ["--router-policy", router_policy] if router_policy else []
    if broker_free:
        procs = [ProcSpec("server", "server", "infera.server", [*common, "--host", host, "--port", str(port), *policy])]
    else:
        procs = [
            ProcSpec("kv-indexer", "kv-indexer", "infera_kv_indexer", [*common, "--metrics-port", str(metrics_ports[0])]),
            ProcSpec("router", "router", "infera_router", [*common, "--metrics-port", str(metrics_ports[1]), *policy]),
            ProcSpec("frontend", "frontend", "infera_frontend", [*common, "--host", host, "--port", str(port)]),
        ]
    if pd_protocol not in PD_ARGS:
        raise ValueError(f"unknown PD protocol {pd_protocol!r}; choose one of {', '.join(PD_ARGS)}")
    prefill_args, decode_args = PD_ARGS[pd_protocol]
    kinds = ([("worker", "mock", [])] * workers
             + [("prefill", "prefill", prefill_args)] * prefill_workers
             + [("decode", "decode", decode_args)] * decode_workers)
    # bootstrap port 0: the mock binds a free one and reports it; its agent registers that
    pd_env = {BOOTSTRAP_PORT_ENV: "0"} if pd_protocol == "vllm-mooncake" else {}
    counts: dict[str, int] = {}
    for n, (name, wid, pd_args) in enumerate(kinds):
        i = counts[name] = counts.get(name, 0) + 1
        procs.append(
            ProcSpec(
                f"{name}-{i}",
                "worker",
                "infera_worker_agent",
                [*common, "--engine", "mock", "--worker-id", f"{wid}-{i}",
                 "--metrics-port", str(metrics_ports[n + 2]), *default_engine_args(), *pd_args, *engine_args],
                env=pd_env if name != "worker" else {},
            )
        )
    return procs
