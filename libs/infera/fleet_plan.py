"""The default local fleet as data: which processes `infera up` starts, with which arguments.

Pure: no I/O. `compose.yaml` describes the same topology for containers, and a test checks that
the two agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from infera_common.models import BUNDLED_MODEL_NAME


@dataclass(frozen=True)
class ProcSpec:
    name: str  # e.g. "router", "frontend", "worker-1"
    role: str  # "router" | "frontend" | "worker"
    module: str  # python -m target
    args: list[str] = field(default_factory=list)

    def argv(self, python: str) -> list[str]:
        return [python, "-m", self.module, *self.args]


def default_engine_args() -> list[str]:
    """Mock-engine arguments of the default fleet (the agent adds the bundled --model-path)."""
    return ["--served-model-name", BUNDLED_MODEL_NAME]


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
) -> list[ProcSpec]:
    """kv-indexer, router, frontend and ``workers`` mock worker-agents, all on the NATS plane.

    ``metrics_ports`` holds one free port per kv-indexer, router and worker-agent, in that order
    (the frontend serves /metrics on its own HTTP port).
    """
    if workers < 1:
        raise ValueError("--workers must be at least 1")
    if len(metrics_ports) < workers + 2:
        raise ValueError("need one metrics port for the kv-indexer, the router and each worker")
    common = ["--nats-url", nats_url, "--log-format", log_format]
    indexer_args = [*common, "--metrics-port", str(metrics_ports[0])]
    router_args = [*common, "--metrics-port", str(metrics_ports[1])]
    if router_policy:
        router_args += ["--router-policy", router_policy]
    procs = [
        ProcSpec("kv-indexer", "kv-indexer", "infera_kv_indexer", indexer_args),
        ProcSpec("router", "router", "infera_router", router_args),
        ProcSpec("frontend", "frontend", "infera_frontend", [*common, "--host", host, "--port", str(port)]),
    ]
    for i in range(1, workers + 1):
        procs.append(
            ProcSpec(
                f"worker-{i}",
                "worker",
                "infera_worker_agent",
                [*common, "--engine", "mock", "--worker-id", f"mock-{i}",
                 "--metrics-port", str(metrics_ports[i + 1]), *default_engine_args(), *engine_args],
            )
        )
    return procs
