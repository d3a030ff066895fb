"""The worker-agent on the no-broker plane and on mixed planes, as real processes.

The runbook's worker command runs verbatim over the mock engine with etcd discovery, direct HTTP
requests and ZMQ KV events, and no nats-server anywhere: a listening socket stands where NATS would
be (``INFERA_NATS_URL``) and must never be dialled.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
import time

import aiohttp
import pytest
import zmq
import zmq.asyncio
from nats.js.errors import NotFoundError

from infera.procs import free_port
from infera_common.discovery_etcd import EtcdWatcher
from infera_common.kv_wire import END_SEQ, BlockStored, decode_batch, decode_seq, encode_seq, replay_reply
from infera_common.schemas import WorkerStatus
from infera_common.subjects import load_subject, request_stream

from .agent_proc import AgentProc, alive, group_members
from .test_agent_kv_process import KvStream
from .test_agent_process import bus, eventually, report_running  # noqa: F401  (fixture)


class NatsTrap:
    """A listening socket where NATS would be: any connection attempt is visible."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.sock.setblocking(False)
        self.url = f"nats://127.0.0.1:{self.sock.getsockname()[1]}"

    def dialled(self) -> bool:
        try:
            conn, _ = self.sock.accept()
        except BlockingIOError:
            return False
        conn.close()
        return True


class Fleet:
    """The test's etcd view of the fleet, every change stamped with when it was seen."""

    def __init__(self, endpoint: str) -> None:
        self.changes: list[tuple[float, str, WorkerStatus]] = []
        self.watcher = EtcdWatcher(endpoint, on_change=lambda c: self.changes.append(
            (time.monotonic(), c.kind, c.record.status)))

    async def active(self, timeout: float = 30.0):
        def find():
            return next((r for r in self.watcher.view.workers() if r.status == WorkerStatus.ACTIVE), None)

        assert await eventually(lambda: find() is not None, timeout), self.changes
        return find()

    def first(self, kind: str, status: WorkerStatus | None = None) -> float | None:
        return next((t for t, k, s in self.changes if k == kind and (status is None or s == status)), None)


@pytest.fixture
async def fleet(etcd_server):
    f = Fleet(etcd_server.endpoint)
    await f.watcher.start()
    yield f
    await f.watcher.stop()


@pytest.fixture
def runbook_worker(etcd_server, model_dir, tmp_path, subprocess_env):
    """Start the runbook's worker command verbatim; the agent's own metrics on a free port (env)."""
    trap = NatsTrap()
    started: list[AgentProc] = []

    def start(name: str) -> AgentProc:
        env = {**subprocess_env, "INFERA_METRICS_PORT": "0", "INFERA_NATS_URL": trap.url}
        a = AgentProc(trap.url, tmp_path, env, name)
        a.argv = [
            sys.executable, "-m", "infera.engine.mock", "--model", str(model_dir), "--port", str(free_port()),
            "--host", "0.0.0.0", "--advertise-host", "127.0.0.1", "--etcd-endpoint", etcd_server.endpoint,
            "--discovery-backend", "etcd", "--request-transport", "http", "--kv-event-transport", "zmq",
        ]
        started.append(a.start())
        return a

    start.trap = trap
    yield start
    for a in started:
        a.cleanup()
    trap.sock.close()


def long_prompt(n: int) -> list[dict]:
    words = " ".join(f"word{n}x{i}" for i in range(120))  # several full 64-token blocks
    return [{"role": "user", "content": f"Request {n}: {words}"}]


def agent_output(a: AgentProc) -> str:
    return a.err_path.read_text(errors="replace") + a.out_path.read_text(errors="replace")


async def stored_blocks(sub: zmq.asyncio.Socket, timeout: float) -> list[tuple[int, BlockStored]]:
    """(seq, event) of every BlockStored that arrives on ``sub`` within ``timeout``."""
    out = []
    deadline = time.monotonic() + timeout
    while (remaining := deadline - time.monotonic()) > 0:
        if not await sub.poll(remaining * 1000, zmq.POLLIN):
            break
        _topic, seq, payload = await sub.recv_multipart()
        out += [(decode_seq(seq), e) for e in decode_batch(payload).events if isinstance(e, BlockStored)]
        if out:
            break
    return out


async def replayed_seqs(endpoint: str, ctx: zmq.asyncio.Context) -> list[int]:
    """Ask the replay ROUTER for everything from seq 0; the seqs it answers before its end marker."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        await dealer.send_multipart([b"", encode_seq(0)])
        seqs = []
        while await dealer.poll(10_000, zmq.POLLIN):
            seq, _ = replay_reply(await dealer.recv_multipart())
            if seq == END_SEQ:
                return seqs
            seqs.append(seq)
        raise AssertionError(f"no end marker from {endpoint} after {seqs}")
    finally:
        dealer.close()


async def read_stream(session: aiohttp.ClientSession, url: str, body: dict, first: asyncio.Event) -> list[dict]:
    chunks = []
    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return chunks
            chunks.append(json.loads(line[len("data: "):]))
            first.set()
    raise AssertionError(f"stream ended without [DONE] after {len(chunks)} chunks")


async def test_runbook_worker_serves_the_no_broker_plane_and_drains_a_stream(runbook_worker, fleet):
    agent = runbook_worker("runbook")
    record = await fleet.active()
    assert (record.discovery_backend, record.request_transport, record.kv_event_transport) == ("etcd", "http", "zmq")
    port = int(agent.argv[agent.argv.index("--port") + 1])
    assert record.url == f"http://127.0.0.1:{port}"  # the advertise host, not the 0.0.0.0 bind
    assert record.max_pending == 512 and record.kv_block_size == 64
    assert len(record.kv_events_endpoints) == len(record.kv_replay_endpoints) == 1
    assert record.kv_events_endpoints[0].startswith("tcp://127.0.0.1:")
    assert record.kv_replay_endpoints[0].startswith("tcp://127.0.0.1:")

    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(record.kv_events_endpoints[0])
    try:
        async with aiohttp.ClientSession() as session:
            stored: list[tuple[int, BlockStored]] = []
            for n in range(10):  # a SUB takes a moment to join: ask again until its events arrive
                body = {"model": record.model, "messages": long_prompt(n), "max_tokens": 4}
                async with session.post(f"{record.url}/v1/chat/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    answer = await resp.json()
                assert answer["choices"][0]["message"]["content"] and answer["usage"]["prompt_tokens"] > 128
                stored = await stored_blocks(sub, 3.0)
                if stored:
                    break
            assert stored, "no BlockStored on the advertised KV-event endpoint"
            seq, event = stored[0]
            assert event.block_size == record.kv_block_size and len(event.token_ids) % event.block_size == 0
            assert seq in await replayed_seqs(record.kv_replay_endpoints[0], ctx)

            engine_pid = agent.engine_pid()
            first_chunk = asyncio.Event()
            body = {"model": record.model, "messages": long_prompt(99), "max_tokens": 400, "stream": True}
            stream = asyncio.create_task(read_stream(session, record.url, body, first_chunk))
            await asyncio.wait_for(first_chunk.wait(), 30)
            os.kill(agent.pid, signal.SIGTERM)
            chunks = await asyncio.wait_for(stream, 60)
            stream_done = time.monotonic()
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert await asyncio.to_thread(agent.wait, 30) == 0
        assert await eventually(lambda: fleet.first("leave") is not None, 10), fleet.changes
        draining = fleet.first("update", WorkerStatus.DRAINING)
        assert draining is not None and draining < stream_done < fleet.first("leave"), fleet.changes
        assert fleet.watcher.view.workers() == []
        assert not alive(engine_pid) and not group_members(engine_pid) and not alive(agent.watchdog_pid())
    finally:
        sub.close()
        ctx.term()
    assert agent.event("engine_idle") is not None
    assert "nats" not in agent_output(agent).lower()
    assert not runbook_worker.trap.dialled()


async def test_engine_death_on_the_no_broker_plane_deregisters_and_exits_with_its_code(runbook_worker, fleet):
    agent = runbook_worker("runbook-dies")
    await fleet.active()
    os.kill(agent.engine_pid(), signal.SIGKILL)
    assert await asyncio.to_thread(agent.wait, 30) == 128 + signal.SIGKILL
    assert await eventually(lambda: fleet.first("leave") is not None, 5), fleet.changes
    assert agent.event("engine_exited") is not None
    assert "nats" not in agent_output(agent).lower()
    assert not runbook_worker.trap.dialled()


async def a_routers_request_is_not_reported_as_someone_elses(bus, url: str) -> None:
    """On http a router calls the engine itself and counts the request in its own lease: the agent's
    load report must not count it again as a request beside the agent (``engine_unseen``)."""
    load_sub = await bus.nc.subscribe(load_subject("mix-http"))
    async with aiohttp.ClientSession() as session:
        body = {"model": "smol", "messages": long_prompt(1), "max_tokens": 2000, "stream": True}
        async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
            await resp.content.readline()  # the stream is under way
            report = await report_running(load_sub, 1)
            assert (report.in_flight, report.engine_running, report.engine_unseen) == (0, 1, 0)
    await load_sub.unsubscribe()


async def test_http_requests_with_discovery_and_kv_events_on_nats(bus, nats_server, tmp_path, subprocess_env):
    """A mix: NATS for discovery and the KV relay, requests straight to the engine's HTTP API."""
    agent = AgentProc(nats_server, tmp_path, subprocess_env, "mix-http",
                      ["--request-transport", "http", "--load-interval", "0.1"], ["--served-model-name", "smol"]).start()
    try:
        record = await bus.active("mix-http")
        assert (record.discovery_backend, record.request_transport, record.kv_event_transport) == (
            "nats", "http", "nats")
        with pytest.raises(NotFoundError):  # no work queue: routers call the engine
            await bus.js.stream_info(request_stream("mix-http"))
        stream = await KvStream().follow(bus.js, "mix-http")
        async with aiohttp.ClientSession() as session:
            body = {"model": "smol", "messages": long_prompt(1), "max_tokens": 2}
            async with session.post(f"{record.url}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
        assert await eventually(lambda: stream.stored_hashes() != set(), 20), stream.relays
        assert stream.relays[0].kind == "cleared"
        await a_routers_request_is_not_reported_as_someone_elses(bus, record.url)
        os.kill(agent.pid, signal.SIGTERM)
        assert await asyncio.to_thread(agent.wait, 30) == 0
        statuses = [c.record.status for c in bus.changes if c.record.worker_id == "mix-http"]
        assert WorkerStatus.DRAINING in statuses
        assert await eventually(lambda: bus.watcher.view.get("mix-http") is None, 5)
        assert agent.event("engine_idle") is not None
    finally:
        agent.cleanup()
