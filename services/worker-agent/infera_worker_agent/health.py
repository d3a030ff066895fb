"""Talking to the engine outside requests: startup health, the served model, its reports."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import aiohttp

from infera_common.dp_pin import pin_body, rank_headers
from infera_common.logs import get_logger
from infera_common.tasks import stop_tasks
from infera_worker_agent.engine_proc import EngineProcess
from infera_worker_agent.liveness import CanaryReason, Liveness, RankStallCheck, StallCheck
from infera_worker_agent.load import EngineLoad

log = get_logger("worker_agent.health")

POLL_INTERVAL = 0.25
PROGRESS_EVERY = 5.0


class Startup(StrEnum):
    HEALTHY = "healthy"
    EXITED = "exited"  # the engine process ended during startup
    TIMEOUT = "timeout"
    STOPPED = "stopped"  # the agent was asked to stop


async def is_healthy(session: aiohttp.ClientSession, base_url: str, timeout: float = 5.0) -> bool:
    try:
        async with session.get(f"{base_url}/health", timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            return resp.status == 200
    except (aiohttp.ClientError, OSError, TimeoutError):
        return False


class Canary(StrEnum):
    ANSWERED = "answered"  # the one-token completion came back
    PROGRESS = "progress"  # it had not, but the engine's token counters moved meanwhile
    REFUSED = "refused"  # the engine answered it with an error status: its HTTP side works, no verdict
    FAILED = "failed"  # no connection or a broken one: a failed probe
    SILENT = "silent"  # neither within the timeout: the engine is stalled


async def send_canary(session: aiohttp.ClientSession, base_url: str, model: str, timeout: float,
                      moved: Callable[[], bool], poll: float = 0.25, dp_rank: int | None = None) -> Canary:
    """A one-token completion to the engine, as SGLang's /health sends itself one; passed as soon as
    ``moved()`` says the engine made progress anyway (SGLang's rule). The request is dropped (its
    connection closed, which aborts it in the engine) whichever way the wait ends. With ``dp_rank``
    it is pinned to that data-parallel rank, both ways the engines read it (``dp_pin``)."""
    body = pin_body({"model": model, "prompt": "ping", "max_tokens": 1, "temperature": 0, "stream": False}, dp_rank)
    headers = {"X-Request-Id": f"infera-canary-{uuid.uuid4().hex[:12]}", **rank_headers(dp_rank)}

    async def post() -> Canary:
        try:
            async with session.post(f"{base_url}/v1/completions", json=body, headers=headers) as resp:
                await resp.read()
                return Canary.ANSWERED if resp.status < 400 else Canary.REFUSED
        except (aiohttp.ClientError, OSError):
            return Canary.FAILED

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    task = asyncio.create_task(post(), name="engine-canary")
    try:
        while True:
            await asyncio.wait({task}, timeout=max(0.0, min(poll, deadline - loop.time())))
            if task.done():
                return task.result()
            if moved():
                return Canary.PROGRESS
            if loop.time() >= deadline:
                return Canary.SILENT
    finally:
        await stop_tasks(task)


@dataclass(frozen=True, slots=True)
class StallProbe:
    """What the health watch needs to test an engine that holds work and counts no progress."""

    work: Callable[[], int]  # requests the engine holds (running + waiting, or in flight through the agent)
    progress: Callable[[], float | None]  # its token counters summed (None: it has none)
    # (timeout, moved, DP rank or None) -> outcome
    canary: Callable[[float, Callable[[], bool], int | None], Awaitable[Canary]]
    # per DP rank the agent's requests were pinned to: (requests in flight, frames they sent)
    ranks: Callable[[], dict[int, tuple[int, int]]] = dict
    # seconds since the engine's /metrics last answered
    metrics_silent_for: Callable[[], float] = lambda: 0.0
    # the engine's data-parallel ranks: idle canaries take them in turn (each its own scheduler)
    dp_size: int = 1


@dataclass(frozen=True)
class ProbeFailRule:
    """For an engine no canary can test (an SGLang prefill or decode leg): what makes one failed
    health probe conclusive, as it is under the stall check (``HealthWatch.probe_once``): the engine
    holds requests and its /metrics has not answered for as long as the probe waited. Without it a
    frozen leg took three probes, each waiting out --health-check-timeout: ~2 minutes."""

    work: Callable[[], int]
    metrics_silent_for: Callable[[], float]


def engine_stall_probe(session: aiohttp.ClientSession, base_url: str, model: str,
                       last_load: Callable[[], EngineLoad], in_flight: Callable[[], int],
                       by_rank: Callable[[], dict[int, tuple[int, int]]] = dict,
                       metrics_silent_for: Callable[[], float] = lambda: 0.0, dp_size: int = 1) -> StallProbe:
    """The stall probe of a serving engine: its load from the latest scrape, what the agent has in
    flight on it (in sequences: ``n`` samples each; per DP rank, ``by_rank``), and canaries to its
    OpenAI completions endpoint for the model it serves."""
    return StallProbe(
        work=lambda: max(last_load().work, in_flight()),
        progress=lambda: last_load().tokens,
        canary=lambda timeout, moved, rank: send_canary(session, base_url, model, timeout, moved, dp_rank=rank),
        ranks=by_rank,
        metrics_silent_for=metrics_silent_for,
        dp_size=dp_size,
    )


class HealthWatch:
    """While the worker serves: probe the engine's /health every ``interval`` seconds (each probe
    given ``timeout``), and call ``on_change(healthy)`` when ``Liveness`` changes its verdict.

    With a ``stall`` probe, a round whose /health passes also asks ``StallCheck`` whether a canary
    is due (the engine held work through the whole round without counting a token; an earlier
    canary went unanswered; or, with ``idle_canary_after``, it has been idle that long); one that
    gets nothing back (nor sees progress) within ``timeout`` makes the engine unhealthy at once.
    """

    def __init__(self, session: aiohttp.ClientSession, base_url: str, *, interval: float, timeout: float,
                 failures: int, on_change: Callable[[bool], Awaitable[None]], stall: StallProbe | None = None,
                 idle_canary_after: float = 0.0,
                 on_canary: Callable[[CanaryReason, Canary], None] = lambda _reason, _outcome: None,
                 fail_rule: ProbeFailRule | None = None) -> None:
        self._session, self._url = session, base_url
        self._interval, self._timeout = interval, timeout
        self.liveness = Liveness(failures)
        self._on_change = on_change
        self._stall, self._check = stall, StallCheck(idle_canary_after)
        self._rank_check = RankStallCheck()
        self._on_canary = on_canary
        self._fail_rule = fail_rule
        self._told_refused = False
        self._told_rank: int | None = None  # the rank last said to be stalled (said once, not every round)
        self._idle_turn = 0  # the DP rank the next idle canary is pinned to (mod dp_size)
        self._suspect_pin: int | None = None  # the rank a canary that went unanswered was pinned to
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="engine-health")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await stop_tasks(task)

    async def probe_once(self) -> None:
        """One round: /health, then a canary when one is due; updates ``liveness``. A failed probe
        is one of ``failures`` strikes, unless the engine holds work and either counted no token
        through the whole round before it or left its /metrics unanswered for as long as the probe
        waited: then it is unhealthy at once, as after a silent canary."""
        ok = await is_healthy(self._session, self._url, self._timeout)
        stall = self._stall
        if stall is None:
            rule = self._fail_rule
            if not ok and rule is not None and self._metrics_silent_with_work(work := rule.work(),
                                                                              rule.metrics_silent_for):
                self._tell_stalled(CanaryReason.STALLED, work, None, probe_failed=True)
                self.liveness.stalled()
                return
            self.liveness.observe(ok)
            return
        loop = asyncio.get_running_loop()
        work, mark = stall.work(), stall.progress()
        reason = self._check.canary_due(work, mark, loop.time())
        if not ok:
            if reason in (CanaryReason.STALLED, CanaryReason.SUSPECT) or self._metrics_silent_with_work(
                    work, stall.metrics_silent_for):
                # it held work through a whole round and counted nothing, or its /metrics has not
                # answered for as long as this probe waited, and now it fails its probe (a frozen
                # process times out, SGLang's generating /health answers 503): no canary could say more
                self._check.canary_done(True, loop.time())  # under test until it answers again
                self._tell_stalled(reason or CanaryReason.STALLED, work, None, probe_failed=True)
                self.liveness.stalled()
            else:
                self.liveness.observe(False)
            return
        ranks = stall.ranks()
        rank = self._rank_check.rank_due(ranks) if reason is None else None
        if reason is None and rank is None:
            self.liveness.observe(True)
            return
        pin = None
        if rank is None:
            pin = self._whole_engine_pin(reason, stall.dp_size)
            outcome = await stall.canary(self._timeout, lambda: stall.progress() != mark, pin)
            self._check.canary_done(outcome is Canary.SILENT, loop.time())
            self._suspect_pin = pin if outcome is Canary.SILENT else None
        else:
            reason, before = CanaryReason.RANK, ranks.get(rank)

            def moved() -> bool:  # the rank's requests got frames meanwhile (none held: the canary decides)
                now = stall.ranks().get(rank)
                return now is not None and before is not None and now[1] != before[1]

            outcome = await stall.canary(self._timeout, moved, rank)
            self._rank_check.canary_done(rank, outcome is Canary.SILENT)
            if outcome is not Canary.SILENT:
                self._told_rank = None
        self._on_canary(reason, outcome)
        if outcome is Canary.SILENT:
            self._tell_stalled(reason, work if rank is None else ranks.get(rank, (0, 0))[0], rank, pin=pin)
            self.liveness.stalled()
            return
        if outcome is Canary.REFUSED and not self._told_refused:  # once, not every round
            self._told_refused = True
            log.warning("engine_canary_refused", url=self._url, note="the engine answered the one-token completion "
                        "with an error status; its /health passed, so it counts as healthy, and the stall check "
                        "cannot tell a hang from work (logged once)")
        self.liveness.observe(outcome is not Canary.FAILED)

    def _metrics_silent_with_work(self, work: int, metrics_silent_for: Callable[[], float]) -> bool:
        """The engine holds requests and its /metrics has been silent as long as a probe waits: with
        a failed probe, conclusive (a frozen process)."""
        return work > 0 and metrics_silent_for() >= self._timeout

    def _whole_engine_pin(self, reason: CanaryReason | None, dp_size: int) -> int | None:
        """The DP rank a canary that tests the engine as a whole is pinned to: an idle canary takes
        the ranks in turn (unpinned, the engine's own balancer may send every one to the same rank,
        and a rank that hung while idle would never be met); a canary after one that went
        unanswered goes to the same rank (another rank answering would not clear it). A canary
        for a stall under load goes unpinned: any rank that works answers it."""
        if reason is CanaryReason.SUSPECT:
            return self._suspect_pin
        if reason is CanaryReason.IDLE and dp_size > 1:
            self._idle_turn = (self._idle_turn + 1) % dp_size
            return self._idle_turn
        return None

    def _tell_stalled(self, reason: CanaryReason, work: int, rank: int | None, probe_failed: bool = False,
                      pin: int | None = None) -> None:
        if reason is CanaryReason.SUSPECT or (rank is not None and self._told_rank == rank):
            return  # said when it stalled; the verdict stands, quietly
        self._told_rank = rank
        if probe_failed:
            what = ("the engine holds requests, counted no token for a whole round (or its /metrics did not "
                    "answer for as long) and then failed its health probe (no answer within "
                    "--health-check-timeout, or an error)")
        elif reason is CanaryReason.IDLE:
            pinned = f" pinned to DP rank {pin}" if pin is not None else ""
            what = f"the engine held no request and left a one-token completion{pinned} unanswered"
        elif reason is CanaryReason.RANK:
            what = (f"DP rank {rank} of the engine holds requests, sent none of them a frame for a whole health "
                    "round while the other ranks may work, and did not answer a one-token completion pinned to it")
        else:
            what = "the engine holds requests, counts no token and did not answer a one-token completion"
        log.error("engine_stalled", url=self._url, reason=reason.value, requests=work, canary_timeout_s=self._timeout,
                  dp_rank=rank if pin is None else pin,
                  hint=f"{what}; a hung GPU or collective looks like this. It gets no new requests "
                  "until it makes progress again (restart it if it stays so)")

    async def _run(self) -> None:
        told = True  # the verdict the worker's record carries (it went active healthy)
        while True:
            await asyncio.sleep(self._interval)
            await self.probe_once()
            if self.liveness.healthy != told:
                try:
                    await self._on_change(self.liveness.healthy)
                    told = self.liveness.healthy
                except Exception as exc:  # broker hiccup: told again after the next probe
                    log.warning("health_change_not_published", healthy=self.liveness.healthy, error=str(exc))


async def wait_healthy(
    session: aiohttp.ClientSession,
    base_url: str,
    engine: EngineProcess,
    timeout: float,
    stop: asyncio.Event,
) -> Startup:
    """Poll the engine's /health until it answers 200, the engine exits, ``timeout`` or ``stop``."""
    start = time.monotonic()
    next_progress = start + PROGRESS_EVERY
    while True:
        if stop.is_set():
            return Startup.STOPPED
        if engine.returncode is not None:
            return Startup.EXITED
        if await is_healthy(session, base_url):
            # a process that answers and then dies at once did not start
            return Startup.EXITED if engine.returncode is not None else Startup.HEALTHY
        now = time.monotonic()
        if now - start >= timeout:
            return Startup.TIMEOUT
        if now >= next_progress:
            next_progress = now + PROGRESS_EVERY
            log.info("waiting_for_engine", url=base_url, elapsed_s=round(now - start, 1), timeout_s=timeout,
                     pid=engine.pid)
        waiter = asyncio.create_task(stop.wait())
        exited = asyncio.create_task(engine.wait())
        await asyncio.wait({waiter, exited}, timeout=POLL_INTERVAL, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        exited.cancel()


@dataclass(frozen=True, slots=True)
class ModelCard:
    """The first entry of the engine's ``/v1/models``: the served name and its ``max_model_len``
    (SGLang and vLLM both give the model's context length there; None when absent), and the ids of
    the entries after it that name the same model (``aliases``: vLLM lists one entry per
    ``--served-model-name``), and those of its LoRA adapters (``adapters``: an adapter's entry names
    its base model in ``parent``), and its ``root`` (the model path the engine loaded: vLLM's
    ``--model``)."""

    id: str
    max_model_len: int | None = None
    aliases: tuple[str, ...] = ()
    adapters: tuple[str, ...] = ()
    root: str | None = None


def read_models(data: object) -> ModelCard | None:
    """The card of a ``/v1/models`` body's ``data`` list; None when its first entry has no id."""
    if not isinstance(data, list) or not data or not isinstance(data[0], dict) or not data[0].get("id"):
        return None
    first = str(data[0]["id"])
    length = data[0].get("max_model_len")
    valid = isinstance(length, int) and not isinstance(length, bool) and length > 0
    entries = [e for e in data[1:] if isinstance(e, dict) and e.get("id")]
    aliases = dict.fromkeys(str(e["id"]) for e in entries if e.get("parent") is None)
    aliases.pop(first, None)
    adapters = dict.fromkeys(str(e["id"]) for e in entries if e.get("parent") is not None)
    for name in (first, *aliases):
        adapters.pop(name, None)
    root = data[0].get("root")
    return ModelCard(first, length if valid else None, tuple(aliases), tuple(adapters),
                     root if isinstance(root, str) and root else None)


def refused_length(card: ModelCard | None, server_info: dict[str, Any] | None) -> int | None:
    """The context length the engine refuses prompts at (the record's ``context_length``): the
    card's ``max_model_len``, unless the engine cuts long prompts down instead (SGLang's
    ``--allow-auto-truncate``, in its ``/server_info``), when a client's long prompt is not an error."""
    if card is None or (server_info or {}).get("allow_auto_truncate") is True:
        return None
    return card.max_model_len


async def served_model(session: aiohttp.ClientSession, base_url: str, attempts: int = 10) -> ModelCard | None:
    """The model the engine serves, from its /v1/models (``read_models``)."""
    for attempt in range(attempts):
        try:
            async with session.get(f"{base_url}/v1/models", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                if resp.status == 200:
                    card = read_models((await resp.json(content_type=None)).get("data"))
                    if card is not None:
                        return card
                log.warning("engine_models_unusable", status=resp.status, attempt=attempt)
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError, AttributeError) as exc:
            log.warning("engine_models_failed", error=str(exc) or type(exc).__name__, attempt=attempt)
        await asyncio.sleep(0.5)
    return None


async def engine_json(session: aiohttp.ClientSession, url: str) -> object | None:
    """GET ``url`` as JSON; None when the engine does not serve it (e.g. real vLLM's /server_info)."""
    return await _engine_get(session, url, lambda resp: resp.json(content_type=None))


async def engine_text(session: aiohttp.ClientSession, url: str) -> str | None:
    """GET ``url`` as text (e.g. the engine's /metrics); None when it cannot be read."""
    return await _engine_get(session, url, aiohttp.ClientResponse.text)


async def _engine_get(session: aiohttp.ClientSession, url: str,
                      read: Callable[[aiohttp.ClientResponse], Awaitable[Any]]) -> Any:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as resp:
            if resp.status != 200:
                log.info("engine_info_unavailable", url=url, status=resp.status)
                return None
            return await read(resp)
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:  # UnicodeDecodeError is one
        log.info("engine_info_failed", url=url, error=str(exc) or type(exc).__name__)
        return None


async def bootstrap_ranks(session: aiohttp.ClientSession, url: str, attempts: int = 10,
                          interval: float = 0.5) -> dict | None:
    """vLLM's Mooncake bootstrap ``GET /query``: ``{dp_rank: {engine_id, worker_addr}}``.

    The prefill's workers register with it while the engine starts; an empty answer is asked again.
    """
    for _ in range(attempts):
        data = await engine_json(session, url)
        if isinstance(data, dict) and data:
            return data
        await asyncio.sleep(interval)
    log.warning("bootstrap_query_empty", url=url, attempts=attempts)
    return None
