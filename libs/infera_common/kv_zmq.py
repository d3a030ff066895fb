"""Reading an engine's ZMQ KV events: one SUB socket per DP rank, in seq order, gaps filled from replay.

Used by the worker-agent (each batch relayed into JetStream) and by the kv-indexer on
``--kv-event-transport zmq`` (each batch applied to its index): the reading is the same, what
happens to an in-order batch is the caller's ``on_batch(source, seq, payload)``.

- One SUB socket (topic ``""``) per rank publisher; messages are ``[topic, 8-byte seq, payload]``.
- Missed batches are asked from the rank's replay ROUTER (a DEALER sends ``[b"", start_seq]`` and
  gets ``[b"", seq, payload]`` frames up to seq ``END_SEQ``): once right after subscribing (ZMQ's
  slow joiner: the first batches may precede the subscription; for a late reader, the engine's whole
  buffered history) and whenever a seq jumps; they are handed on in order before the batch that
  revealed the gap. ``ready`` is set once every rank's first replay is over.
- With ``on_restart``, a seq going backwards with other content than the batch handled under it
  is an engine restarted behind the same endpoint: ``on_restart(source, seq)`` is awaited, the
  rank's ordering starts over, and the batch is handled as the new engine's (replay fills what
  came before it).
- A bad message, a failed replay or a failing ``on_batch`` is logged and reported to the
  ``KvReadObserver``; the reader keeps going. A rank whose socket cannot be opened (the endpoint
  to bind still held, a monitor address taken) is tried again every ``SUBSCRIBE_RETRY`` seconds
  at most, never given up while the reader runs.
- Each monitor socket gets its own inproc address: pyzmq's default names it after the socket's file
  descriptor, which a new socket reuses while a closed one's name is still held (EADDRINUSE), and a
  worker that left and joined again within moments was never read again.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from infera_common.kv_seq import RankSeq, Verdict, fill_plan
from infera_common.kv_wire import END_SEQ, REPLAY_TIMEOUT, KvWireError, decode_seq, encode_seq, replay_reply
from infera_common.logs import get_logger
from infera_common.tasks import stop_tasks

_log = get_logger("kv_zmq")

_UP_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED
#: Not EVENT_MONITOR_STOPPED: asked for, libzmq waits to deliver it when the monitor stops (``_close``
#: stops it first), to a reader that is gone: the close then hung, or, without the stop, kept three
#: file descriptors of every closed SUB socket (a kv-indexer following workers that come and go ran
#: out of them after ~300 leaves and joins).
_DOWN_EVENTS = zmq.EVENT_DISCONNECTED
#: Longest wait (seconds) between two attempts to open a rank's socket that could not be opened.
SUBSCRIBE_RETRY = 5.0
_monitor_ids = itertools.count()


def _stop_monitor(sock: zmq.asyncio.Socket) -> None:
    """Stop ``sock``'s monitor, if it has one. Only while the monitor's reading socket is still open:
    libzmq's I/O thread hands each event over with a blocking send, holding the socket's monitor lock,
    and with the reading end closed that send waits for ever, and the stop with it (a reader closed
    just as its socket connected hung its whole process; found by a clean-clone CI run, session 24)."""
    if not sock.closed:
        try:
            sock.disable_monitor()
        except zmq.ZMQError:  # it had none
            pass


def _close(sock: zmq.asyncio.Socket) -> None:
    """Close ``sock``, its monitor stopped first: a SUB closed while its monitor still had an event
    to hand over (closed just after connecting) kept three file descriptors for good."""
    if not sock.closed:
        _stop_monitor(sock)
        sock.close(linger=0)


@dataclass(frozen=True, slots=True)
class ZmqKvSource:
    """One DP rank's publisher as the reader opens it: ``endpoint`` is dialled (or bound, with
    ``bind``: the engine connects out to it), ``replay_endpoint`` dialled (None: no replay)."""

    dp_rank: int
    endpoint: str
    replay_endpoint: str | None = None
    bind: bool = False


OnBatch = Callable[[ZmqKvSource, int, bytes], Awaitable[None]]
OnRestart = Callable[[ZmqKvSource, int], Awaitable[None]]


class KvReadObserver:
    """What a reader reports as it goes, for its user's metrics. Every hook is a no-op here."""

    def connected(self, source: ZmqKvSource, up: bool) -> None:
        """The SUB socket's peer came up / went down (only with ``monitor=True``)."""

    def malformed(self, source: ZmqKvSource, reason: str) -> None:
        """A message that is not ``[topic, 8-byte seq, payload]`` (dropped)."""

    def gap_detected(self, source: ZmqKvSource, missing: range) -> None:
        """Seqs ``missing`` were skipped; a replay is asked (if there is a replay socket)."""

    def gap_closed(self, source: ZmqKvSource, missing: range, lost: int) -> None:
        """The gap's replay is over: ``lost`` of ``missing`` could not be recovered (0 = filled)."""

    def replayed(self, source: ZmqKvSource, batches: int) -> None:
        """``batches`` batches recovered from the replay socket were handed on."""

    def restarted(self, source: ZmqKvSource, seq: int) -> None:
        """The engine behind ``source`` restarted (its seq went back to ``seq``)."""


class KvZmqReader:
    def __init__(
        self,
        sources: Iterable[ZmqKvSource],
        on_batch: OnBatch,
        *,
        on_restart: OnRestart | None = None,
        observer: KvReadObserver | None = None,
        replay_timeout: float = REPLAY_TIMEOUT,
        context: zmq.asyncio.Context | None = None,
        monitor: bool = False,
        log_fields: Mapping[str, Any] | None = None,
    ) -> None:
        self.sources = tuple(sources)
        self._on_batch = on_batch
        self._on_restart = on_restart
        self.observer = observer or KvReadObserver()
        self.replay_timeout = replay_timeout
        self._ctx = context
        self._owns_ctx = context is None
        self._monitor = monitor
        self._log = _log.bind(**dict(log_fields or {}))
        self._tasks: list[asyncio.Task] = []
        self._sockets: list[zmq.asyncio.Socket] = []
        self._waiting = 0  # ranks whose first replay is not over yet
        self.ready = asyncio.Event()  # every rank's first replay is over (at once without replay sockets)

    # --- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        """Open every rank's SUB socket and start reading (the first replay runs in the background)."""
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        self._waiting = len(self.sources)
        if not self._waiting:
            self.ready.set()
        for source in self.sources:
            try:
                sub, mon = self._subscribe(source)
            except zmq.ZMQError as exc:  # the endpoint to bind still held, say: tried again, never given up
                self._log.warning("kv_subscribe_failed", dp_rank=source.dp_rank, endpoint=source.endpoint,
                                  error=str(exc), retry_within_s=SUBSCRIBE_RETRY)
                self._rank_ready()  # not read yet: readiness does not wait for it
                self._tasks.append(asyncio.create_task(self._subscribe_again(source),
                                                       name=f"kv-zmq-retry-{source.dp_rank}"))
                continue
            self._start_rank(source, sub, mon)

    def _start_rank(self, source: ZmqKvSource, sub: zmq.asyncio.Socket, mon: zmq.asyncio.Socket | None,
                    counted: bool = True) -> None:
        if mon is not None:
            self._tasks.append(asyncio.create_task(self._watch(source, sub, mon),
                                                   name=f"kv-zmq-mon-{source.dp_rank}"))
        self._tasks.append(asyncio.create_task(self._run_rank(source, sub, counted), name=f"kv-zmq-{source.dp_rank}"))

    async def _subscribe_again(self, source: ZmqKvSource) -> None:
        delay, attempts = 0.25, 1
        while True:
            await asyncio.sleep(delay)
            attempts += 1
            try:
                sub, mon = self._subscribe(source)
            except zmq.ZMQError as exc:
                if attempts % 12 == 0:  # about once a minute at the longest wait
                    self._log.warning("kv_subscribe_failed", dp_rank=source.dp_rank, endpoint=source.endpoint,
                                      error=str(exc), attempts=attempts)
                delay = min(delay * 2, SUBSCRIBE_RETRY)
                continue
            self._log.info("kv_subscribed", dp_rank=source.dp_rank, endpoint=source.endpoint, attempts=attempts)
            self._start_rank(source, sub, mon, counted=False)
            return

    async def close(self) -> None:
        for sock in self._sockets:  # before the tasks close the monitors' reading sockets (_stop_monitor)
            _stop_monitor(sock)
        await stop_tasks(*self._tasks)
        self._tasks.clear()
        for sock in self._sockets:
            _close(sock)
        self._sockets.clear()
        if self._owns_ctx and self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    # --- one rank --------------------------------------------------------------------------------
    def _subscribe(self, source: ZmqKvSource) -> tuple[zmq.asyncio.Socket, zmq.asyncio.Socket | None]:
        """The rank's SUB socket, and its monitor (set up before connecting, so no event is missed)."""
        assert self._ctx is not None
        sub = self._ctx.socket(zmq.SUB)
        self._sockets.append(sub)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        if "[" in source.endpoint:
            sub.setsockopt(zmq.IPV6, 1)
        mon = None
        try:
            if self._monitor:
                addr = f"inproc://infera-kv-monitor-{os.getpid()}-{next(_monitor_ids)}"  # (module doc)
                mon = sub.get_monitor_socket(_UP_EVENTS | _DOWN_EVENTS, addr=addr)
                self._sockets.append(mon)
            if source.bind:
                sub.bind(source.endpoint)
            else:
                sub.connect(source.endpoint)
        except zmq.ZMQError:
            for sock in (sub, mon):  # the monitored socket first (_stop_monitor)
                if sock is not None:
                    self._sockets.remove(sock)
                    _close(sock)
            raise
        return sub, mon

    def _rank_ready(self) -> None:
        self._waiting -= 1
        if self._waiting <= 0:
            self.ready.set()

    async def _run_rank(self, source: ZmqKvSource, sub: zmq.asyncio.Socket, counted: bool = True) -> None:
        """Read one rank; ``counted``: its first replay is one ``ready`` waits for (False: it was
        opened late, after readiness gave up on it)."""
        state = RankSeq(detect_restarts=self._on_restart is not None)
        first_replay_over = not counted
        try:
            if source.replay_endpoint:  # whatever was published before the subscription took hold
                replayed = await self._replay(source, 0)
                if replayed and min(replayed) > 0:
                    self._log.info("kv_history_truncated", dp_rank=source.dp_rank, first_seq=min(replayed))
                handed = 0
                for seq in sorted(replayed):
                    if state.verdict(seq, replayed[seq]) is not Verdict.DUPLICATE:
                        await self._deliver(source, state, seq, replayed[seq])
                        handed += 1
                if handed:
                    self.observer.replayed(source, handed)
            if not first_replay_over:
                first_replay_over = True
                self._rank_ready()
            while True:
                frames = await sub.recv_multipart()
                await self._on_message(source, state, frames)
        except asyncio.CancelledError:
            raise
        except Exception:  # never expected; this rank stops, the process keeps serving
            self._log.exception("kv_rank_reader_failed", dp_rank=source.dp_rank)
        finally:
            if not first_replay_over:
                self._rank_ready()
            _close(sub)

    async def _on_message(self, source: ZmqKvSource, state: RankSeq, frames: list[bytes]) -> None:
        if len(frames) != 3:
            self._malformed(source, f"{len(frames)} frames, expected 3")
            return
        try:
            seq = decode_seq(frames[1])
        except KvWireError as exc:
            self._malformed(source, str(exc))
            return
        payload = frames[2]
        verdict = state.verdict(seq, payload)
        if verdict is Verdict.DUPLICATE:
            return
        if verdict is Verdict.RESTART:
            await self._restarted(source, state, seq)
            verdict = state.verdict(seq, payload)
        if verdict is Verdict.GAP:
            await self._fill_gap(source, state, seq)
        await self._deliver(source, state, seq, payload)

    async def _restarted(self, source: ZmqKvSource, state: RankSeq, seq: int) -> None:
        assert self._on_restart is not None
        self._log.warning("kv_engine_restarted", dp_rank=source.dp_rank, seq=seq, last_seq=state.last)
        self.observer.restarted(source, seq)
        state.restart()
        try:
            await self._on_restart(source, seq)
        except asyncio.CancelledError:
            raise
        except Exception:
            self._log.exception("kv_restart_handler_failed", dp_rank=source.dp_rank)

    async def _fill_gap(self, source: ZmqKvSource, state: RankSeq, seq: int) -> None:
        missing = state.missing(seq)
        self.observer.gap_detected(source, missing)
        replayed = await self._replay(source, missing.start) if source.replay_endpoint else {}
        found, lost = fill_plan(missing, replayed)
        for missed_seq, payload in found:
            await self._deliver(source, state, missed_seq, payload)
        if found:
            self.observer.replayed(source, len(found))
        self.observer.gap_closed(source, missing, len(lost))
        if lost:
            self._log.warning("kv_gap_unrecoverable", dp_rank=source.dp_rank, missing_from=missing.start,
                              missing_to=missing.stop - 1, lost=len(lost), replay=source.replay_endpoint)
        else:
            self._log.info("kv_gap_filled", dp_rank=source.dp_rank, missing_from=missing.start,
                           missing_to=missing.stop - 1)

    async def _deliver(self, source: ZmqKvSource, state: RankSeq, seq: int, payload: bytes) -> None:
        try:
            await self._on_batch(source, seq, payload)
        except asyncio.CancelledError:
            raise
        except Exception:  # the user's bug: this batch is skipped, the next ones still come
            self._log.exception("kv_batch_handler_failed", dp_rank=source.dp_rank, seq=seq)
        state.handled(seq, payload)

    async def _replay(self, source: ZmqKvSource, start: int) -> dict[int, bytes]:
        """Batches with seq >= ``start`` from the rank's replay socket (what arrived before a timeout)."""
        assert source.replay_endpoint is not None and self._ctx is not None
        out: dict[int, bytes] = {}
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.replay_timeout
        try:
            if "[" in source.replay_endpoint:
                dealer.setsockopt(zmq.IPV6, 1)
            dealer.connect(source.replay_endpoint)
            await dealer.send_multipart([b"", encode_seq(start)])
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0 or not await dealer.poll(remaining * 1000, zmq.POLLIN):
                    self._log.warning("kv_replay_timeout", dp_rank=source.dp_rank, start=start, got=len(out),
                                      timeout_s=self.replay_timeout)
                    return out
                try:
                    seq, payload = replay_reply(await dealer.recv_multipart())
                except KvWireError as exc:
                    self._malformed(source, f"replay: {exc}")
                    continue
                if seq == END_SEQ:
                    return out
                out[seq] = payload
        except zmq.ZMQError as exc:
            self._log.warning("kv_replay_failed", dp_rank=source.dp_rank, start=start, error=str(exc))
            return out
        finally:
            dealer.close(linger=0)

    async def _watch(self, source: ZmqKvSource, sub: zmq.asyncio.Socket, mon: zmq.asyncio.Socket) -> None:
        """Follow the SUB socket's monitor: report its peer coming up and going down. Its reading socket
        ``mon`` is closed only after ``sub``'s monitor is stopped (``_stop_monitor``)."""
        up = False
        try:
            while True:
                event = parse_monitor_message(await mon.recv_multipart())["event"]
                now = True if event & _UP_EVENTS else False if event & _DOWN_EVENTS else up
                if now != up:
                    up = now
                    self.observer.connected(source, up)
                    self._log.info("kv_endpoint_up" if up else "kv_endpoint_down", dp_rank=source.dp_rank,
                                   endpoint=source.endpoint)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a monitor failure only loses the connection report
            self._log.warning("kv_monitor_failed", dp_rank=source.dp_rank, error=str(exc))
        finally:
            if up:
                self.observer.connected(source, False)
            _stop_monitor(sub)
            mon.close(linger=0)

    def _malformed(self, source: ZmqKvSource, why: str) -> None:
        self.observer.malformed(source, why)
        self._log.warning("kv_message_malformed", dp_rank=source.dp_rank, reason=why)
