"""Watching the engine while the worker serves: its load reports and its health probes, with
the stall check that tests an engine holding work and counting no token (``health.HealthWatch``),
and its served names (``names_watch``).
Started once the worker is active; the health probes stop first on the way out (their verdicts
would overwrite ``draining``), the load reports last."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import aiohttp

from infera_common.schemas import LoadReport, Role
from infera_worker_agent.health import HealthWatch, ModelCard, ProbeFailRule, StallProbe, engine_stall_probe
from infera_worker_agent.load import EngineLoad, LoadReporter
from infera_worker_agent.metrics import AgentMetrics
from infera_worker_agent.names_watch import NamesWatch
from infera_worker_agent.pd_role import Family
from infera_worker_agent.settings import AgentSettings


def stall_checked(settings: AgentSettings, role: Role, family: Family) -> bool:
    """Whether the stall check runs: on, and on an engine that serves its canary, a plain one-token
    completion. Every aggregated one does, and a vLLM prefill or decode leg: its KV connector leaves a
    request without ``kv_transfer_params`` to run as an ordinary one (Mooncake's, vLLM 0.32). An SGLang
    leg refuses a request without bootstrap fields: its canary would need a pair."""
    return (settings.health_check_interval > 0 and settings.engine_stall_check
            and (role is Role.AGGREGATED or family == "vllm"))


def finds_hangs(settings: AgentSettings, role: Role, family: Family, health_generates: bool) -> bool:
    """Whether the agent takes an engine that hangs while it holds requests out of routing (and hands
    those requests back): its health probes run, and either they generate (SGLang's ``/health``) or
    the stall check tests an engine that holds work and counts no token. Only then may requests that
    wait on the engine be said to be alive (``RequestRunner``'s ``alive`` frames). SGLang's
    generating ``/health`` tests a prefill or decode leg too: in disaggregation mode it gives its
    one-token request a fake bootstrap host, which needs no pair (``health_generate``, SGLang 0.5.19)."""
    return settings.health_check_interval > 0 and (health_generates or stall_checked(settings, role, family))


class EngineWatch:
    def __init__(self, settings: AgentSettings, session: aiohttp.ClientSession, local_url: str, *, model: str,
                 role: Role, family: Family, metrics: AgentMetrics, in_flight: Callable[[], int],
                 sequences: Callable[[], int], by_router: Callable[[], dict[str, int]],
                 work_by_router: Callable[[], dict[str, tuple[int, int]]],
                 by_rank: Callable[[], dict[int, tuple[int, int]]],
                 publish_load: Callable[[LoadReport], Awaitable[None]], on_health: Callable[[bool], Awaitable[None]],
                 health_generates: bool = False, dp_size: int = 1, names: ModelCard | None = None,
                 on_names: Callable[[ModelCard], Awaitable[None]] | None = None,
                 resolvable: Callable[[ModelCard], Awaitable[ModelCard]] | None = None) -> None:
        self._metrics = metrics
        self.names = None if names is None or on_names is None else NamesWatch(
            session, local_url, settings.models_interval, names, on_names, sticky=family == "sglang",
            resolvable=resolvable)
        self.reporter: LoadReporter | None = LoadReporter(
            worker_id=settings.worker_id or "", session=session, metrics_url=f"{local_url}/metrics",
            interval=settings.load_interval, in_flight=in_flight, sequences=sequences, by_router=by_router,
            work_by_router=work_by_router,
            publish=publish_load, on_load=self._on_load,
            counts_unseen=settings.request_transport == "nats",  # on http the routers call the engine
        )
        self.health: HealthWatch | None = None
        if settings.health_check_interval > 0:
            stall: StallProbe | None = None
            fail_rule: ProbeFailRule | None = None
            reporter = self.reporter
            if stall_checked(settings, role, family):
                stall = engine_stall_probe(session, local_url, model, lambda: reporter.last, sequences, by_rank,
                                           reporter.silent_for, dp_size)
            elif settings.engine_stall_check:  # no canary for it (an SGLang leg): the probe rule alone
                fail_rule = ProbeFailRule(work=lambda: max(reporter.last.work, sequences()),
                                          metrics_silent_for=reporter.silent_for)
            self.health = HealthWatch(
                session, local_url, interval=settings.health_check_interval, timeout=settings.health_check_timeout,
                failures=settings.health_check_failures, on_change=on_health, stall=stall,
                # an engine whose /health generates (SGLang's) is tested by every probe, idle or not
                idle_canary_after=0.0 if health_generates else settings.engine_idle_canary_after,
                on_canary=lambda reason, outcome: metrics.canaries.labels(outcome.value, reason.value).inc(),
                fail_rule=fail_rule,
            )

    def start(self) -> None:
        if self.names is not None:
            self.names.start()
        if self.reporter is not None:
            self.reporter.start()
        if self.health is not None:
            self.health.start()

    async def stop_health(self) -> None:
        health, self.health = self.health, None
        if health is not None:
            await health.stop()

    async def stop(self) -> None:
        names, self.names = self.names, None
        if names is not None:
            await names.stop()
        await self.stop_health()
        reporter, self.reporter = self.reporter, None
        if reporter is not None:
            await reporter.stop()

    def engine_work(self) -> int | None:
        """The engine's running + waiting requests at the last scrape (None: no scrape yet, or stopped)."""
        return self.reporter.last.work if self.reporter is not None else None

    def _on_load(self, load: EngineLoad) -> None:
        self._metrics.engine_running.set(load.running)
        self._metrics.engine_waiting.set(load.waiting)
        self._metrics.engine_kv_usage.set(load.kv_usage)
