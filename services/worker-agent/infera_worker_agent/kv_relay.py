"""Relaying the engine's ZMQ KV events to JetStream, in order, with gaps filled from replay.

One SUB socket (topic "") per DP-rank publisher. Every batch becomes one ``KvRelay(kind="batch")``
carrying the engine's seq and payload verbatim, published on ``kv_event_subject(worker_id)`` with
the JetStream ack awaited (so order and persistence hold). A ``KvRelay(kind="cleared")`` goes out
first: the engine starts with an empty cache, so anything indexed for this worker id is stale.

Missed batches are asked from the rank's replay ROUTER (DEALER sends ``[b"", start_seq]``, gets
``[b"", seq, payload]`` frames up to seq ``END_SEQ``) — once right after subscribing (ZMQ's slow
joiner: the first batches may precede the subscription) and whenever a seq jumps — and relayed in
order before the batch that revealed the gap. A bad message, a failed replay or a failed publish is
logged and counted; the relay keeps going.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

import zmq
import zmq.asyncio

from infera_common.kv_wire import END_SEQ, BlockStored, KvWireError, decode_batch, decode_seq, encode_seq
from infera_common.logs import get_logger
from infera_common.schemas import KvRelay
from infera_worker_agent.kv_config import KvSource, local_endpoint, subscriber_binds
from infera_worker_agent.kv_seq import SeqTracker, Verdict, fill_plan
from infera_worker_agent.metrics import AgentMetrics

log = get_logger("worker_agent.kv_relay")

Publish = Callable[[KvRelay], Awaitable[None]]
REPLAY_TIMEOUT = 3.0


class KvRelayer:
    def __init__(
        self,
        worker_id: str,
        sources: Sequence[KvSource],
        block_size: int | None,
        publish: Publish,
        metrics: AgentMetrics,
        replay_timeout: float = REPLAY_TIMEOUT,
        on_block_size: Callable[[int], Awaitable[None]] | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.sources = list(sources)
        self.block_size = block_size
        # the engine's events carry its real block size: the first one stored settles it (vLLM on CPU
        # defaults to 128 where the GPU default is 16, and vLLM has no /server_info to say so)
        self._on_block_size = on_block_size
        self._block_size_seen = False
        self._publish = publish
        self.metrics = metrics
        self.replay_timeout = replay_timeout
        self._ctx = zmq.asyncio.Context()
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        """Publish ``cleared`` (before anything else), then relay every rank."""
        await self._send(KvRelay(worker_id=self.worker_id, kind="cleared", dp_rank=None, block_size=self.block_size))
        for source in self.sources:
            sub = self._subscribe(source)
            self._tasks.append(asyncio.create_task(self._run_rank(source, sub), name=f"kv-relay-{source.dp_rank}"))
        log.info("kv_relay_started", worker_id=self.worker_id, block_size=self.block_size,
                 sources=[(s.dp_rank, s.endpoint, s.replay_endpoint) for s in self.sources])

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        self._ctx.destroy(linger=0)

    # --- one rank ------------------------------------------------------------------------------
    def _subscribe(self, source: KvSource) -> zmq.asyncio.Socket:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        if subscriber_binds(source.endpoint):  # the engine connects out to us
            sub.bind(source.endpoint)
        else:
            sub.connect(local_endpoint(source.endpoint))
        return sub

    async def _run_rank(self, source: KvSource, sub: zmq.asyncio.Socket) -> None:
        tracker = SeqTracker()
        try:
            if source.replay_endpoint:  # whatever was published before the subscription took hold
                replayed = await self._replay(source, 0)
                for seq in sorted(replayed):
                    if tracker.check(seq) is not Verdict.DUPLICATE:
                        await self._relay_batch(source.dp_rank, seq, replayed[seq])
                        tracker.relayed(seq)
            while True:
                frames = await sub.recv_multipart()
                await self._on_message(source, tracker, frames)
        except asyncio.CancelledError:
            raise
        except Exception:  # never expected; the relay of this rank stops, the agent keeps serving
            log.exception("kv_relay_rank_failed", dp_rank=source.dp_rank)
        finally:
            sub.close(linger=0)

    async def _on_message(self, source: KvSource, tracker: SeqTracker, frames: list[bytes]) -> None:
        if len(frames) != 3:
            self._malformed(source, f"{len(frames)} frames, expected 3")
            return
        try:
            seq = decode_seq(frames[1])
        except KvWireError as exc:
            self._malformed(source, str(exc))
            return
        verdict = tracker.check(seq)
        if verdict is Verdict.DUPLICATE:
            return
        if verdict is Verdict.GAP:
            await self._fill_gap(source, tracker, seq)
        await self._relay_batch(source.dp_rank, seq, frames[2])
        tracker.relayed(seq)

    async def _fill_gap(self, source: KvSource, tracker: SeqTracker, seq: int) -> None:
        missing = tracker.missing(seq)
        self.metrics.kv_gaps.labels("detected").inc()
        replayed = await self._replay(source, missing.start) if source.replay_endpoint else {}
        found, lost = fill_plan(missing, replayed)
        for missed_seq, payload in found:
            await self._relay_batch(source.dp_rank, missed_seq, payload)
            tracker.relayed(missed_seq)
        if lost:
            self.metrics.kv_gaps.labels("unrecoverable").inc()
            self.metrics.kv_lost_batches.inc(len(lost))
            log.warning("kv_gap_unrecoverable", dp_rank=source.dp_rank, missing_from=missing.start,
                        missing_to=missing.stop - 1, lost=len(lost), replay=source.replay_endpoint)
        else:
            self.metrics.kv_gaps.labels("filled").inc()
            log.info("kv_gap_filled", dp_rank=source.dp_rank, missing_from=missing.start, missing_to=missing.stop - 1)

    async def _replay(self, source: KvSource, start: int) -> dict[int, bytes]:
        """Batches with seq >= ``start`` from the rank's replay socket (what arrived before a timeout)."""
        assert source.replay_endpoint is not None
        out: dict[int, bytes] = {}
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.replay_timeout
        try:
            dealer.connect(local_endpoint(source.replay_endpoint))
            await dealer.send_multipart([b"", encode_seq(start)])
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0 or not await dealer.poll(remaining * 1000, zmq.POLLIN):
                    log.warning("kv_replay_timeout", dp_rank=source.dp_rank, start=start, got=len(out),
                                timeout_s=self.replay_timeout)
                    return out
                frames = await dealer.recv_multipart()
                if len(frames) != 3:
                    self._malformed(source, f"replay: {len(frames)} frames, expected 3")
                    continue
                try:
                    seq = decode_seq(frames[1])
                except KvWireError as exc:
                    self._malformed(source, f"replay: {exc}")
                    continue
                if seq == END_SEQ:
                    return out
                out[seq] = frames[2]
        except zmq.ZMQError as exc:
            log.warning("kv_replay_failed", dp_rank=source.dp_rank, start=start, error=str(exc))
            return out
        finally:
            dealer.close(linger=0)

    # --- publishing ----------------------------------------------------------------------------
    async def _relay_batch(self, dp_rank: int, seq: int, payload: bytes) -> None:
        if not self._block_size_seen:
            await self._check_block_size(payload)
        relay = KvRelay(worker_id=self.worker_id, kind="batch", dp_rank=dp_rank, seq=seq, payload=payload,
                        block_size=self.block_size)
        if await self._send(relay):
            self.metrics.kv_batches.labels(str(dp_rank)).inc()

    async def _check_block_size(self, payload: bytes) -> None:
        try:
            events = decode_batch(payload).events
        except KvWireError:
            return  # the indexer counts it; the next batch may tell
        size = next((e.block_size for e in events if isinstance(e, BlockStored)), None)
        if size is None:
            return
        self._block_size_seen = True
        if size == self.block_size:
            return
        log.warning("kv_block_size_corrected", registered=self.block_size, engine_events=size)
        self.block_size = size
        if self._on_block_size is not None:
            await self._on_block_size(size)

    async def _send(self, relay: KvRelay) -> bool:
        try:
            await self._publish(relay)
            return True
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.metrics.kv_publish_failures.inc()
            log.warning("kv_relay_publish_failed", kind=relay.kind, dp_rank=relay.dp_rank, seq=relay.seq,
                        error=str(exc) or type(exc).__name__)
            return False

    def _malformed(self, source: KvSource, why: str) -> None:
        self.metrics.kv_malformed.inc()
        log.warning("kv_message_malformed", dp_rank=source.dp_rank, reason=why)
