"""Publishes KV event batches on ZMQ the way vLLM's and SGLang's ZmqEventPublisher do.

- PUB socket: multipart `[topic, seq (8-byte big-endian, from 0), msgpack batch]`, sent with
  NOBLOCK from the event loop (a slow or absent subscriber never stalls the scheduler: the batch is
  dropped by ZMQ at the high-water mark, like any PUB socket). Bound when the endpoint has `*`/`::`
  (or is ipc/inproc), connected otherwise.
- Optional ROUTER replay socket (always bound): a DEALER sends `[b"", start_seq]`; every buffered
  batch with seq >= start_seq is answered (ROUTER adds the identity), then an end marker (seq -1),
  framed as each engine frames it: SGLang `[b"", seq, payload]` / `[b"", -1, b""]`; vLLM (0.32)
  `[b"", topic, seq, payload]` / `[b"", b"", -1, b""]`. The last `buffer_steps` batches are kept.
  Served by an asyncio task (zmq.asyncio), never by polling.

The endpoint of DP rank r is the configured one with its port offset by r.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from infera_mock_engine.event_wire import END_SEQ, encode_batch, encode_seq
from infera_mock_engine.kv_events import KvEvent
from infera_mock_engine.kv_events_config import KvEventsConfig, binds, offset_endpoint_port, split_tcp

log = logging.getLogger("infera_mock_engine.kv_events")
_REPLAY_YIELD_EVERY = 256


class PublisherError(RuntimeError):
    """A KV-events socket could not be set up (the message names the endpoint)."""


class KvEventPublisher:
    def __init__(self, config: KvEventsConfig, flavor: str, block_size: int, dp_rank: int = 0,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.flavor = flavor
        self.block_size = block_size
        self.dp_rank = dp_rank
        self.clock = clock
        self.endpoint = offset_endpoint_port(config.endpoint, dp_rank) or config.endpoint
        self.replay_endpoint = offset_endpoint_port(config.replay_endpoint, dp_rank)
        self.bound_endpoint: str | None = None  # after start: the endpoint actually bound / connected
        self.bound_replay_endpoint: str | None = None
        self.next_seq = 0
        self.dropped = 0
        self._topic = config.topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._ctx: zmq.Context | None = None
        self._pub: zmq.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task | None = None

    # ---- lifecycle -------------------------------------------------------------
    def start(self) -> None:
        """Open the sockets (raises PublisherError) and, with a replay endpoint, serve replays."""
        self._ctx = zmq.Context()
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.set_hwm(self.config.hwm)
            self.bound_endpoint = self._open(self._pub, self.endpoint, bind=binds(self.endpoint))
            if self.replay_endpoint:
                router = self._ctx.socket(zmq.ROUTER)
                router.setsockopt(zmq.LINGER, 0)
                self.bound_replay_endpoint = self._open(router, self.replay_endpoint, bind=True, what="replay endpoint")
                self._replay = zmq.asyncio.Socket.from_socket(router)
                self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay(),
                                                                           name="kv-events-replay")
        except BaseException:
            self._close_sockets()
            raise
        log.info("publishing KV events (%s) on %s%s", self.flavor,
                 ("bound " if binds(self.endpoint) else "connected to ") + str(self.bound_endpoint),
                 f", replay on {self.bound_replay_endpoint}" if self.bound_replay_endpoint else "")

    def _open(self, sock: zmq.Socket, endpoint: str, bind: bool, what: str = "endpoint") -> str:
        if "::" in endpoint or "[" in endpoint:
            sock.setsockopt(zmq.IPV6, 1)
        try:
            if bind:
                sock.bind(endpoint)
                return sock.getsockopt_string(zmq.LAST_ENDPOINT)
            sock.connect(endpoint)
            return endpoint
        except zmq.ZMQError as e:
            verb = "bind" if bind else "connect to"
            raise PublisherError(f"cannot {verb} the KV events {what} {endpoint!r}: {e}") from None

    async def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
            self._replay_task = None
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    # ---- publishing --------------------------------------------------------------
    def publish(self, events: list[KvEvent]) -> None:
        """Send one batch (one scheduler step's events) without blocking; buffer it for replay."""
        if not events or self._pub is None:
            return
        seq = self.next_seq
        self.next_seq += 1
        payload = encode_batch(self.flavor, self.clock(), events, self.dp_rank)
        self._buffer.append((seq, payload))
        try:
            self._pub.send_multipart([self._topic, encode_seq(seq), payload], flags=zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1
        except zmq.ZMQError as e:
            self.dropped += 1
            log.warning("KV event batch %d not sent: %s", seq, e)

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            try:
                frames = await self._replay.recv_multipart()
                if len(frames) != 3 or len(frames[2]) != 8:
                    log.warning("ignoring a malformed KV event replay request (%d frames)", len(frames))
                    continue
                client, _, start = frames
                start_seq = int.from_bytes(start, "big")  # unsigned, as the engines read it
                sent = 0
                topic = [self._topic] if self.flavor == "vllm" else []  # vLLM repeats the topic
                for seq, payload in list(self._buffer):
                    if seq >= start_seq:
                        await self._replay.send_multipart([client, b"", *topic, encode_seq(seq), payload])
                        sent += 1
                        if sent % _REPLAY_YIELD_EVERY == 0:
                            await asyncio.sleep(0)
                await self._replay.send_multipart([client, b"", *([b""] if topic else []), END_SEQ, b""])
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as e:
                if self._replay is None or self._replay.closed:
                    return
                log.warning("KV event replay failed: %s", e)

    # ---- discovery -----------------------------------------------------------------
    def source(self) -> dict[str, Any]:
        """vLLM 0.32's /kv_event_sources entry (its KVEventsConfig of this rank, as bound)."""
        c = self.config
        return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": self.bound_endpoint,
                "replay_endpoint": self.bound_replay_endpoint, "buffer_steps": c.buffer_steps, "hwm": c.hwm,
                "max_queue_size": c.max_queue_size, "topic": c.topic}

    def descriptor(self, dp_size: int = 1) -> dict[str, Any]:
        """SGLang /server_info `kv_events` entry (its keys, plus the resolved endpoints)."""
        host, _ = split_tcp(self.endpoint)
        _, port = split_tcp(self.bound_endpoint or self.endpoint)
        _, replay_port = split_tcp(self.bound_replay_endpoint) if self.bound_replay_endpoint else (None, None)
        return {
            "publisher": "zmq",
            "endpoint_host": host,
            "endpoint_port_base": port,
            "topic": self.config.topic,
            "block_size": self.block_size,
            "dp_size": dp_size,
            "mode": "bind" if binds(self.endpoint) else "connect",
            "endpoint": self.bound_endpoint,
            "endpoints": [self.bound_endpoint],
            "replay_endpoint": self.bound_replay_endpoint,
            "replay_endpoint_port_base": replay_port,
            "buffer_steps": self.config.buffer_steps,
            "next_seq": self.next_seq,
        }
