"""Connecting to NATS, and making sure the JetStream objects a service needs exist."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import nats
from nats.aio.client import Client as NATS
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.client import JetStreamContext
from nats.js.errors import NotFoundError, ServiceUnavailableError

from infera_common.logs import get_logger
from infera_common.subjects import KV_EVENT_STREAM, KV_EVENT_SUBJECTS, request_stream, work_subject
from infera_common.tasks import stop_tasks

log = get_logger("nats")


#: Seconds between attempts of a restore step that failed (JetStream may still be starting).
RESTORE_RETRY = 0.5
#: Attempts of one restore step before it is left to the next reconnect (~30 s).
RESTORE_ATTEMPTS = 60

Restore = Callable[[], Awaitable[None]]


class Reconnects:
    """What a service redoes each time its connection comes back.

    A restarted nats-server has lost every memory stream (the discovery bucket, the workers'
    request queues) and, without its store directory, the KV event stream too, with every consumer
    on them; core subscriptions nats-py renews by itself. Each owner of broker state adds a step
    that checks its state and recreates what is missing (a no-op after a mere network blip). The
    steps run in order, in a task of their own, each retried while JetStream is not answering yet.
    """

    def __init__(self) -> None:
        self._steps: list[tuple[str, Restore]] = []
        self._listeners: list[Callable[[], None]] = []
        self._task: asyncio.Task | None = None
        self._again = False

    def add(self, name: str, step: Restore) -> None:
        self._steps.append((name, step))

    def listen(self, told: Callable[[], None]) -> None:
        """Call ``told`` at each reconnect, at once (before the steps, which may take seconds)."""
        self._listeners.append(told)

    def reconnected(self) -> None:
        """Tell the listeners; run the steps (once more after the current run, if one is going)."""
        for told in self._listeners:
            told()
        self._again = True
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._runs(), name="nats-restore")

    async def _runs(self) -> None:
        while self._again:
            self._again = False
            await self.run()

    async def run(self) -> None:
        for name, step in list(self._steps):
            for attempt in range(1, RESTORE_ATTEMPTS + 1):
                try:
                    await step()
                    break
                except Exception as exc:
                    if attempt == RESTORE_ATTEMPTS:
                        log.error("restore_failed", step=name, attempts=attempt, error=str(exc) or type(exc).__name__)
                    else:
                        await asyncio.sleep(RESTORE_RETRY)

    async def close(self) -> None:
        if self._task is not None:
            await stop_tasks(self._task)
            self._task = None


#: Seconds between two log lines of one NATS error while it repeats: nats-py reports every reconnect
#: attempt, every 0.5 s while the broker is away.
ERROR_LOG_EVERY = 30.0


class RepeatedErrors:
    """Which errors to log (pure; the clock is given): the first of its kind at once, the same one
    again at most every ``every`` seconds, with how many were held back meanwhile."""

    def __init__(self, every: float) -> None:
        self.every = every
        self._seen: dict[str, tuple[float, int]] = {}  # error -> (when last logged, held back since)

    def let_through(self, error: str, now: float) -> int | None:
        """None: hold this one back; else log it, with the count held back since the last one logged."""
        seen = self._seen.get(error)
        if seen is not None and now - seen[0] < self.every:
            self._seen[error] = (seen[0], seen[1] + 1)
            return None
        self._seen[error] = (now, 0)
        return 0 if seen is None else seen[1]

    def clear(self) -> None:
        self._seen.clear()


#: How often each client pings the broker, and how many pings may go unanswered before it takes the
#: connection for dead and reconnects: a stalled broker or a silent network cut is noticed within
#: 9-12 s (nats-py's defaults, 120 s and 2, took 6-8 minutes), however idle the service is. (A loop
#: held for long adds one ping, not several: the pinging task sleeps on the same loop.)
PING_INTERVAL_S = 3.0
MAX_OUTSTANDING_PINGS = 2

#: Why a service run on its own dials NATS although its plane flags need none (etcd, http, zmq).
BETWEEN_SERVICES = ("the frontend, router and kv-indexer, run as separate processes, talk to one another over NATS "
                    "whatever the plane flags; to run them without a broker, run them as one process: "
                    "python -m infera.server with the same flags")


async def connect(url: str, name: str, connect_timeout: float = 10.0, reconnects: Reconnects | None = None,
                  *, planes_need_it: bool = True) -> NATS:
    """Connect within ``connect_timeout`` (else ``ConnectionError`` naming the fix), then reconnect forever;
    after each reconnect ``reconnects`` (if given) restores the broker state its steps own.
    ``planes_need_it``: False for a service whose plane flags need no NATS (the message then says why
    it is needed all the same: ``BETWEEN_SERVICES``).

    nats-py retries an unreachable server forever inside ``nats.connect`` when reconnecting is
    unlimited, and on Python 3.11 one cancellation can be lost inside its own ``wait_for``; so the
    attempt runs as a task with a deadline and is re-cancelled until it has really stopped.
    """

    repeats = RepeatedErrors(ERROR_LOG_EVERY)

    async def on_error(exc: Exception) -> None:
        error = str(exc) or type(exc).__name__
        held = repeats.let_through(error, time.monotonic())
        if held is not None:
            log.warning("nats_error", error=error, **({"repeated": held} if held else {}))

    connected: list[NATS] = []  # the client, once connected: a disconnect while it closes is no news

    async def on_disconnect() -> None:
        if connected and connected[0].is_closed:
            log.info("nats_closed")
        else:
            log.warning("nats_disconnected")

    async def on_reconnect() -> None:
        repeats.clear()  # a later outage is logged from its first error
        log.info("nats_reconnected")
        if reconnects is not None:
            reconnects.reconnected()

    task = asyncio.create_task(
        nats.connect(
            servers=url.split(","),
            name=name,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            error_cb=on_error,
            disconnected_cb=on_disconnect,
            reconnected_cb=on_reconnect,
            connect_timeout=2,
            allow_reconnect=True,
            ping_interval=PING_INTERVAL_S,
            max_outstanding_pings=MAX_OUTSTANDING_PINGS,
        ),
        name="nats-connect",
    )
    try:
        done, _ = await asyncio.wait({task}, timeout=connect_timeout)
    finally:  # also when the caller itself is cancelled (SIGTERM during start-up)
        await stop_tasks(task)
    if not done or task.exception() is not None:
        cause = task.exception() if done else None
        raise ConnectionError(
            f"cannot reach NATS at {url} within {connect_timeout:g}s"
            + (f" ({cause})" if cause else "")
            + "; start nats-server with JetStream (nats-server -js) or pass --nats-url / INFERA_NATS_URL"
            + ("" if planes_need_it else f" ({BETWEEN_SERVICES})")
        ) from cause
    connected.append(task.result())
    return connected[0]


#: what to tell the user when a JetStream API call answers "service unavailable" (503) at start
NO_JETSTREAM = ("JetStream is unavailable on the NATS server (its API answered 503: JetStream is not enabled, or a "
                "cluster has no quorum); start nats-server with -js, or pass --nats-url / INFERA_NATS_URL of one "
                "that has JetStream")


def no_jetstream(exc: BaseException) -> bool:
    """Whether ``exc`` is the JetStream API's "service unavailable": a server without JetStream."""
    return isinstance(exc, ServiceUnavailableError)


async def flush_all(nc, timeout: float = 10.0) -> None:
    """Return once the server has processed everything this client sent before the call.

    nats-py's ``flush()`` writes its PING to the socket at once, ahead of the commands still queued
    for its flusher task (2.16: a SUB just made can reach the server after the PONG came back, so a
    request right after met "no responders" about once in 400 tries). The first flush sets the
    flusher going, so the queue is on the socket before its PONG is read; the second PING follows
    the queue, and its PONG says the server has it all.
    """
    await nc.flush(timeout)
    await nc.flush(timeout)


async def ensure_request_stream(js: JetStreamContext, worker_id: str, max_pending: int, max_age: float) -> str:
    """Create (or update) the worker's work-queue stream; returns its name.

    In memory: a request lives only while its requester waits, and a broker restart ends those
    waits anyway. ``max_msgs`` with discard-new makes the broker refuse a publish when the worker
    already holds ``max_pending`` unfinished requests; the router turns that refusal into 429.
    """
    name = request_stream(worker_id)
    config = StreamConfig(
        name=name,
        subjects=[work_subject(worker_id)],
        retention=RetentionPolicy.WORK_QUEUE,
        storage=StorageType.MEMORY,
        max_msgs=max_pending,
        discard=DiscardPolicy.NEW,
        max_age=max_age,
        num_replicas=1,
    )
    try:
        info = await js.stream_info(name)
    except NotFoundError:
        await js.add_stream(config)
        return name
    if info.config.sealed:  # left sealed by an agent of this worker that stopped before deleting it
        await js.delete_stream(name)
        await js.add_stream(config)
    else:
        await js.update_stream(config)
    return name


async def seal_request_stream(js: JetStreamContext, worker_id: str) -> None:
    """Seal the worker's work-queue stream: the broker refuses every publish from now on (error
    10109, which routers read as "this worker is gone" and try another), while the envelopes
    already stored are still delivered to the worker's consumer. Sealing cannot be undone: only
    an agent on its way out does it, and a restarted agent recreates the stream
    (``ensure_request_stream`` then finds it sealed and replaces it)."""
    info = await js.stream_info(request_stream(worker_id))
    if not info.config.sealed:
        info.config.sealed = True
        await js.update_stream(info.config)


#: Default retention of the KV event stream: how far back a restarted kv-indexer can replay.
KV_EVENT_MAX_AGE = 3600.0
#: Default size bound of the KV event stream (oldest events are discarded first).
KV_EVENT_MAX_BYTES = 1 << 30


def kv_event_stream_config(max_age: float = KV_EVENT_MAX_AGE, max_bytes: int = KV_EVENT_MAX_BYTES) -> StreamConfig:
    """The one definition of the KV event stream (every worker's relayed engine KV event batches).

    Limits retention on file storage, bounded by age and size with the oldest discarded first, so a
    replay from the start is bounded; no per-subject limit (one subject per worker holds its whole
    history). Events older than ``max_age`` are gone: a kv-indexer rebuilt from the stream misses
    their blocks, which costs a recompute, never a wrong answer.
    """
    return StreamConfig(
        name=KV_EVENT_STREAM,
        subjects=[KV_EVENT_SUBJECTS],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        discard=DiscardPolicy.OLD,
        max_age=max_age,
        max_bytes=max_bytes,
        max_msgs=-1,
        max_msgs_per_subject=-1,
        num_replicas=1,
    )


async def ensure_kv_event_stream(
    js: JetStreamContext, max_age: float | None = None, max_bytes: int | None = None
) -> None:
    """Create the KV event stream when absent (limits default to ``KV_EVENT_MAX_AGE``/``_MAX_BYTES``).

    When it exists, limits passed explicitly are applied (the kv-indexer passes its
    ``--kv-event-max-age``/``--kv-event-max-bytes``); limits left ``None`` keep the stream as it is,
    so a worker-agent calling ``ensure_kv_event_stream(js)`` never overrides the indexer's choice.
    """
    config = kv_event_stream_config(
        KV_EVENT_MAX_AGE if max_age is None else max_age, KV_EVENT_MAX_BYTES if max_bytes is None else max_bytes
    )
    try:
        info = await js.stream_info(KV_EVENT_STREAM)
    except NotFoundError:
        try:
            await js.add_stream(config)
            return
        except Exception:  # another service created it first
            info = await js.stream_info(KV_EVENT_STREAM)
    if max_age is None and max_bytes is None:
        return
    current = info.config
    wanted_age = current.max_age if max_age is None else max_age
    wanted_bytes = current.max_bytes if max_bytes is None else max_bytes
    if (current.max_age, current.max_bytes) != (wanted_age, wanted_bytes):
        await js.update_stream(kv_event_stream_config(wanted_age, wanted_bytes))


async def unsubscribe_quietly(sub) -> None:
    """Unsubscribe ``sub`` (a nats ``Subscription``, or None); a connection already gone is fine."""
    if sub is None:
        return
    try:
        await sub.unsubscribe()
    except Exception:  # connection closed or draining: the subscription is gone with it
        pass


async def delete_stream_quietly(js: JetStreamContext, name: str) -> None:
    try:
        await js.delete_stream(name)
    except Exception as exc:  # already gone, or the broker is down at shutdown
        log.info("stream_delete_skipped", stream=name, error=str(exc))


async def close_connection(nc: NATS, timeout: float = 5.0) -> None:
    """Drain ``nc`` (deliver what is in flight), else close it, never waiting more than ``timeout``.

    With the server gone, nats-py's drain waits for a reconnect that never comes: a connection that is
    not up (reconnecting) is closed at once, and the drain is bounded, so a service stopping during
    a broker outage still exits in time.
    """
    if nc.is_closed:
        return
    if nc.is_connected:
        try:
            await asyncio.wait_for(nc.drain(), timeout)
            return
        except Exception:  # the broker went away meanwhile, or the drain timed out
            pass
    try:
        await asyncio.wait_for(nc.close(), timeout)
    except Exception as exc:  # nothing more can be done: the process is exiting
        log.info("nats_close_incomplete", error=str(exc) or type(exc).__name__)


def nats_log_fields(nats_url: str, used: bool) -> dict[str, str]:
    """``{"nats_url": ...}`` for a start-up log line when this process dials NATS, else nothing (a
    service on an in-process bus, or a worker on the no-broker plane, never mentions a NATS URL)."""
    return {"nats_url": nats_url} if used else {}
