"""Helpers for the kv-indexer's ZMQ path: a real mock engine process, a hand-driven ZMQ publisher
(PUB + replay ROUTER on 127.0.0.1), an overlap query over any NATS-like client, and polling."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import msgpack
import zmq
import zmq.asyncio

from infera.procs import free_port, stop_process, wait_port
from infera_common.kv_wire import END_SEQ, decode_seq, encode_seq
from infera_common.schemas import OverlapQuery, OverlapReply, WorkerRecord, WorkerStatus, decode, encode
from infera_common.subjects import KV_QUERY
from tests.waiting import eventually

MODEL = "smol"


def zmq_record(worker_id: str, endpoint: str, replay: str = "", *, block_size: int = 16, started_at: float = 1.0,
               advertise_host: str = "127.0.0.1", **kw) -> WorkerRecord:
    """A worker on ``--kv-event-transport zmq`` advertising one publisher (DP rank 0)."""
    return WorkerRecord(worker_id=worker_id, model=MODEL, engine="mock", url="http://127.0.0.1:1",
                        advertise_host=advertise_host, kv_event_transport="zmq", kv_block_size=block_size,
                        kv_events_endpoints=[endpoint], kv_replay_endpoints=[replay], status=WorkerStatus.ACTIVE,
                        started_at=started_at, **kw)


def sample(service, name: str, labels: dict | None = None) -> float:
    return service.metrics.registry.get_sample_value(name, labels or {}) or 0.0


# --- a real mock engine ----------------------------------------------------------------------------
class MockEngineProc:
    """``python -m infera_mock_engine`` with ZMQ KV events on fixed ports (so a restart reuses them)."""

    def __init__(self, model_dir: Path, env: dict[str, str], log_path: Path, flavor: str = "vllm",
                 page: int = 16) -> None:
        self.model_dir, self.env, self.log_path, self.flavor, self.page = model_dir, env, log_path, flavor, page
        self.port, self.pub_port, self.replay_port = free_port(), free_port(), free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def record(self, worker_id: str, started_at: float = 1.0) -> WorkerRecord:
        # as the agent advertises a wildcard bind: the indexer dials the advertise host
        return zmq_record(worker_id, f"tcp://0.0.0.0:{self.pub_port}", f"tcp://0.0.0.0:{self.replay_port}",
                          block_size=self.page, started_at=started_at)

    async def start(self) -> None:
        config = {"publisher": "zmq", "enable_kv_cache_events": True, "endpoint": f"tcp://*:{self.pub_port}",
                  "replay_endpoint": f"tcp://*:{self.replay_port}"}
        argv = [sys.executable, "-m", "infera_mock_engine", "--model-path", str(self.model_dir),
                "--served-model-name", MODEL, "--port", str(self.port), "--engine-flavor", self.flavor,
                "--page-size", str(self.page), "--speedup", "50", "--kv-events-config", json.dumps(config)]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)
        await asyncio.to_thread(wait_port, "127.0.0.1", self.port, 20, self.proc)

        async def healthy() -> bool:
            try:
                async with aiohttp.ClientSession() as s, s.get(f"{self.url}/health") as resp:
                    return resp.status == 200
            except aiohttp.ClientError:
                return False

        await eventually(healthy, timeout=20.0)

    async def complete(self, prompt: list[int]) -> None:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
        async with aiohttp.ClientSession() as s, s.post(f"{self.url}/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
            self.proc = None


# --- a hand-driven publisher -----------------------------------------------------------------------
class FakePublisher:
    """PUB on one port, replay ROUTER on another (both 127.0.0.1); ``history`` is what replay answers.

    ``send(seq, payload)`` records a batch for replay and (unless ``skip``) publishes it; sending the
    same (seq, payload) again is harmless to a reader (a duplicate), which makes it a safe probe
    against ZMQ's slow joiner. ``restart()`` reopens both sockets on the same ports, empty.
    """

    def __init__(self, port: int | None = None, replay_port: int | None = None) -> None:
        self.port, self.replay_port = port or free_port(), replay_port or free_port()
        self.ctx = zmq.asyncio.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(f"tcp://127.0.0.1:{self.port}")
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(f"tcp://127.0.0.1:{self.replay_port}")
        self.history: dict[int, bytes] = {}
        self.replay_requests: list[int] = []
        self._task = asyncio.create_task(self._serve_replay())

    def record(self, worker_id: str, started_at: float = 1.0) -> WorkerRecord:
        return zmq_record(worker_id, f"tcp://127.0.0.1:{self.port}", f"tcp://127.0.0.1:{self.replay_port}",
                          block_size=4, started_at=started_at)

    async def _serve_replay(self) -> None:
        while True:
            ident, _, start = await self.router.recv_multipart()
            first = decode_seq(start)
            self.replay_requests.append(first)
            for seq in sorted(self.history):
                if seq >= first:
                    await self.router.send_multipart([ident, b"", encode_seq(seq), self.history[seq]])
            await self.router.send_multipart([ident, b"", encode_seq(END_SEQ), b""])

    async def send(self, seq: int, payload: bytes, *, skip: bool = False) -> None:
        self.history[seq] = payload
        if not skip:
            await self.pub.send_multipart([b"", encode_seq(seq), payload])

    async def resend(self, seq: int) -> None:
        await self.pub.send_multipart([b"", encode_seq(seq), self.history[seq]])

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self.ctx.destroy(linger=0)


def empty_batch(ts: float) -> bytes:
    return msgpack.packb({"ts": ts, "events": [], "data_parallel_rank": 0})


async def probe_until(pub: FakePublisher, seq: int, check, timeout: float = 20.0):
    """Re-send batch ``seq`` until ``check()`` holds (the reader may not be subscribed yet)."""
    deadline = time.monotonic() + timeout
    while True:
        await pub.resend(seq)
        await asyncio.sleep(0.05)
        if check():
            return
        assert time.monotonic() < deadline, f"batch {seq} never applied"


async def ask_bus(client, query: OverlapQuery) -> OverlapReply:
    """An overlap query over any NATS-like client (a real connection or an in-process bus client)."""
    return decode(OverlapReply, (await client.request(KV_QUERY, encode(query), timeout=5)).data)
