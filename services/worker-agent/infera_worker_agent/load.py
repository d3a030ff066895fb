"""Engine load: parsing the engine's Prometheus text (pure), and the periodic reporter.

Both engine flavours are understood. Request counts are summed over every series (one per DP
rank when the engine runs several); KV-cache usage is their mean, as a fraction 0..1.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from infera_common.logs import get_logger
from infera_common.schemas import LoadReport
from infera_common.tasks import stop_tasks

log = get_logger("worker_agent.load")

RUNNING = ("sglang:num_running_reqs", "vllm:num_requests_running")
WAITING = ("sglang:num_queue_reqs", "vllm:num_requests_waiting")
KV_USAGE = ("sglang:token_usage", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
#: token counters: their sum moves whenever the engine finishes a prefill or makes a token (vLLM, the mock)
#: or finishes a request (SGLang counts a request's tokens when it ends)
TOKENS = ("sglang:prompt_tokens_total", "sglang:generation_tokens_total",
          "vllm:prompt_tokens_total", "vllm:generation_tokens_total")


@dataclass(frozen=True, slots=True)
class EngineLoad:
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    tokens: float | None = None  # the token counters summed; None when the engine has none

    @property
    def work(self) -> int:
        return self.running + self.waiting


def parse_engine_metrics(text: str) -> EngineLoad | None:
    """Engine load from a /metrics page; ``None`` when the page has none of the known series.

    Raises ``ValueError`` when the text is not Prometheus exposition format.
    """
    sums = {"running": [], "waiting": [], "kv": [], "tokens": []}
    kinds = {**{n: "running" for n in RUNNING}, **{n: "waiting" for n in WAITING}, **{n: "kv" for n in KV_USAGE},
             **{n: "tokens" for n in TOKENS}}
    kv_source: str | None = None
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                kind = kinds.get(sample.name)
                if kind is None:
                    continue
                if kind == "kv":  # older vLLM has gpu_cache_usage_perc; never mix two names
                    if kv_source is not None and kv_source != sample.name:
                        continue
                    kv_source = sample.name
                sums[kind].append(sample.value)
    except Exception as exc:  # the parser raises several types on garbage
        raise ValueError(f"not Prometheus text: {exc}") from exc
    if not (sums["running"] or sums["waiting"] or sums["kv"]):
        return None
    kv = sums["kv"]
    return EngineLoad(
        running=int(sum(sums["running"])),
        waiting=int(sum(sums["waiting"])),
        kv_usage=min(max(sum(kv) / len(kv), 0.0), 1.0) if kv else 0.0,
        tokens=sum(sums["tokens"]) if sums["tokens"] else None,
    )


def engine_unseen(load: EngineLoad, in_flight_before: int, in_flight_after: int) -> int:
    """Requests the engine holds that did not come through the agent: its running + waiting less
    the agent's in-flight count, taken before and after the scrape and the larger used. The count
    is of sequences (a request for ``n`` samples runs ``n`` in the engine, each counted running),
    else each request with n > 1 would show n - 1 phantom requests to the routers. A request
    that ended while the scrape was under way is still in the engine's figures but no longer in
    the count taken after it; one that started then is in the count taken after. Subtracting the
    count from after the scrape alone turned each such ending into a phantom request that stayed in
    a router's load until the next report."""
    return max(0, load.running + load.waiting - max(in_flight_before, in_flight_after))


async def scrape_engine(session: aiohttp.ClientSession, metrics_url: str, timeout: float) -> EngineLoad | None:
    """The engine's load from its /metrics; None when the page has none of the known series.

    Raises on a failed request, a non-200 answer or a page that is not Prometheus text.
    """
    async with session.get(metrics_url, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
        if resp.status != 200:
            raise ValueError(f"engine /metrics answered {resp.status}")
        return parse_engine_metrics(await resp.text())


class LoadReporter:
    """Every ``interval`` seconds: scrape the engine, publish a ``LoadReport`` (``publish`` may send
    nothing: without NATS the scrape still feeds the agent's own metrics through ``on_load``).

    A failed scrape keeps the last known engine figures (the report still carries the agent's
    own in-flight count).

    ``counts_unseen`` False (``--request-transport http``): the routers call the engine themselves
    and count those requests in their own leases, none of which pass through the agent, so the
    engine's figures less the agent's count would report every one of them a second time as
    someone else's. The report then says ``engine_unseen=0``, as the no-broker plane, which sends
    no reports at all, leaves each router to its own count.
    """

    def __init__(
        self,
        *,
        worker_id: str,
        session: aiohttp.ClientSession,
        metrics_url: str,
        interval: float,
        in_flight: Callable[[], int],
        publish: Callable[[LoadReport], Awaitable[None]],
        by_router: Callable[[], dict[str, int]] = dict,
        work_by_router: Callable[[], dict[str, tuple[int, int]]] = dict,
        on_load: Callable[[EngineLoad], None] = lambda _load: None,
        sequences: Callable[[], int] | None = None,
        counts_unseen: bool = True,
    ) -> None:
        self._worker_id = worker_id
        self._session = session
        self._url = metrics_url
        self._interval = interval
        self._in_flight = in_flight
        self._sequences = sequences or in_flight  # what the engine runs for them: n samples x prompts each
        self._by_router = by_router
        self._work_by_router = work_by_router
        self._counts_unseen = counts_unseen
        self._publish = publish
        self._on_load = on_load
        self.last = EngineLoad()
        self._unseen = 0  # from the last successful scrape (a failed one says nothing new)
        self._task: asyncio.Task | None = None
        self._warned = False
        self._answered_at = time.monotonic()  # when the engine's /metrics last answered (or the start)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="load-reporter")

    def silent_for(self) -> float:
        """Seconds since the engine's /metrics last answered (since the start, if it never has)."""
        return time.monotonic() - self._answered_at

    async def stop(self) -> None:
        task, self._task = self._task, None
        await stop_tasks(task)

    async def scrape(self) -> EngineLoad | None:
        return await scrape_engine(self._session, self._url, max(min(self._interval, 5.0), 0.5))

    async def report_once(self) -> LoadReport:
        before = self._sequences()
        try:
            load = await self.scrape()
            self._answered_at = time.monotonic()
            if load is not None:
                self.last = load
                if self._counts_unseen:
                    self._unseen = engine_unseen(load, before, self._sequences())
                self._warned = False  # warn again if the engine's metrics go away later
                self._on_load(load)
            elif not self._warned:
                self._warned = True
                log.warning("engine_metrics_without_load", url=self._url)
        except Exception as exc:
            if not self._warned:
                self._warned = True
                log.warning("engine_metrics_unavailable", url=self._url, error=str(exc) or type(exc).__name__)
        report = LoadReport(
            worker_id=self._worker_id,
            in_flight=self._in_flight(),
            in_flight_sequences=self._sequences(),
            by_router=self._by_router(),
            by_router_work=self._work_by_router(),
            engine_running=self.last.running,
            engine_waiting=self.last.waiting,
            engine_unseen=self._unseen,
            kv_usage=self.last.kv_usage,
            report_every=self._interval,
        )
        await self._publish(report)
        return report

    async def _run(self) -> None:
        while True:
            try:
                await self.report_once()
            except Exception as exc:  # NATS hiccup: the next report will do
                log.warning("load_report_failed", error=str(exc))
            await asyncio.sleep(self._interval)
