"""The worker-agent as a real process over the mock engine, on a real nats-server."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import aiohttp
import pytest
from nats.js.errors import BadRequestError, NotFoundError, ServiceUnavailableError

from infera.procs import free_port
from infera_common.discovery import Watcher
from infera_common.nats_conn import connect
from infera_common.schemas import Cancel, Frame, LoadReport, Release, WorkEnvelope, WorkerStatus, decode, encode
from infera_common.subjects import cancel_subject, load_subject, request_stream, router_release_subject, work_subject
from infera_worker_agent.load import parse_engine_metrics

from .agent_proc import AgentProc, alive, group_members
from tests.waiting import eventually

ROUTER = "router-test"




class Client:
    """The test's side of the bus: discovery watcher, release listener, envelope publisher."""

    def __init__(self, nc) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.changes = []
        self.watcher = Watcher(self.js, on_change=self.changes.append, sweep_interval=0.05)
        self.releases: list[Release] = []
        self._n = 0

    async def start(self) -> "Client":
        await self.watcher.start()

        async def on_release(msg):
            self.releases.append(decode(Release, msg.data))

        await self.nc.subscribe(router_release_subject(ROUTER), cb=on_release)
        return self

    async def active(self, worker_id: str, timeout: float = 20.0):
        ok = await eventually(
            lambda: (r := self.watcher.view.get(worker_id)) is not None and r.status == WorkerStatus.ACTIVE, timeout
        )
        assert ok, f"{worker_id} never became active"
        return self.watcher.view.get(worker_id)

    async def submit(self, worker_id: str, body: dict, *, endpoint: str = "/v1/chat/completions",
                     deadline_in: float = 60.0, sequences: int = 1):
        self._n += 1
        rid = f"req-{self._n}"
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox)
        env = WorkEnvelope(request_id=rid, endpoint=endpoint, body=json.dumps(body).encode(),
                           stream=bool(body.get("stream")), reply_subject=inbox, deadline=time.time() + deadline_in,
                           lease_id=f"lease-{rid}", router_id=ROUTER, sequences=sequences)
        await self.js.publish(work_subject(worker_id), encode(env))
        return rid, sub

    async def frames(self, sub, n: int | None = None, timeout: float = 20.0) -> list[Frame]:
        out: list[Frame] = []
        while n is None or len(out) < n:
            out.append(decode(Frame, (await sub.next_msg(timeout=timeout)).data))
            if out[-1].kind in ("end", "error") or out[-1].final:
                break
        return out

    async def release_of(self, rid: str, timeout: float = 10.0) -> list[str]:
        await eventually(lambda: any(r.lease_id == f"lease-{rid}" for r in self.releases), timeout)
        await asyncio.sleep(0.1)
        return [r.outcome for r in self.releases if r.lease_id == f"lease-{rid}"]


@pytest.fixture
async def bus(nats_server):
    nc = await connect(nats_server, "agent-test")
    client = await Client(nc).start()
    yield client
    await client.watcher.stop()
    await nc.close()


@pytest.fixture
def agents(nats_server, tmp_path, subprocess_env):
    started: list[AgentProc] = []

    def start(worker_id: str, agent_args=None, engine_args=None, ttl: float = 2.0) -> AgentProc:
        a = AgentProc(nats_server, tmp_path, subprocess_env, worker_id, agent_args, engine_args, ttl).start()
        started.append(a)
        return a

    yield start
    for a in started:
        a.cleanup()


async def engine_running(url: str) -> int:
    async with aiohttp.ClientSession() as s, s.get(f"{url}/metrics") as resp:
        return parse_engine_metrics(await resp.text()).running


def chat(max_tokens: int, stream: bool, model: str = "smol") -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Tell me a story."}],
            "max_tokens": max_tokens, "stream": stream}


async def test_registers_serves_streams_releases_and_reports_load(bus, agents):
    metrics_port = free_port()
    agent = agents("w-main", ["--metrics-port", str(metrics_port), "--max-pending", "7"],
                   ["--served-model-name", "smol", "--startup-delay", "1", "--context-length", "4096"])
    record = await bus.active("w-main")
    seen = [c.record.status for c in bus.changes if c.record.worker_id == "w-main"]
    assert seen[0] == WorkerStatus.STARTING  # announced, not routable, before health
    assert record.model == "smol"  # the engine's own /v1/models
    assert (record.engine, record.max_pending, record.ttl) == ("mock", 7, 2.0)
    assert record.kv_capacity_tokens == 16384 * 64  # the engine's KV pool, for the routers' eviction term
    assert record.context_length == 4096  # its /v1/models max_model_len: frontends refuse longer requests
    assert not record.clamps_max_tokens  # the sglang flavour refuses prompt + max_tokens past it, as SGLang does
    assert record.url.startswith("http://127.0.0.1:")
    active = agent.event("worker_active", timeout=5)  # its start-up heap is out of the collector's way
    assert active is not None and active["frozen_objects"] > 10_000

    rid, sub = await bus.submit("w-main", chat(4, stream=True))
    frames = await bus.frames(sub)
    assert frames[0].kind == "head" and frames[0].status == 200
    assert frames[-1].kind == "end"
    chunks = [json.loads(f.body) for f in frames[1:-1]]
    assert chunks and all(f.kind == "data" for f in frames[1:-1])
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert await bus.release_of(rid) == ["ok"]

    rid2, sub2 = await bus.submit("w-main", {"model": "smol", "prompt": "Hi", "max_tokens": 3},
                                  endpoint="/v1/completions")
    [head] = await bus.frames(sub2)
    assert (head.kind, head.status, head.final) == ("head", 200, True)
    assert json.loads(head.body)["object"] == "text_completion"
    assert await bus.release_of(rid2) == ["ok"]

    load_sub = await bus.nc.subscribe(load_subject("w-main"))
    report = decode(LoadReport, (await load_sub.next_msg(timeout=5)).data)
    assert report.worker_id == "w-main" and report.in_flight == 0
    assert report.report_every == 1.0  # its --load-interval (the default)

    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{metrics_port}/metrics") as resp:
        text = await resp.text()
    assert 'infera_agent_requests_total{outcome="ok"} 2.0' in text
    assert alive(agent.pid)
    # every line says whose it is, whichever module wrote it (aggregated logs are filtered by it)
    lines = agent.logs()
    unowned = [e for e in lines if (e.get("worker_id"), e.get("service")) != ("w-main", "worker-agent")]
    assert len(lines) > 5 and not unowned, unowned[:3]


async def report_running(load_sub, running: int, reports: int = 50) -> LoadReport:
    """The first of the next ``reports`` load reports in which the engine runs ``running`` sequences
    (else the last one)."""
    for _ in range(reports):
        report = decode(LoadReport, (await load_sub.next_msg(timeout=5)).data)
        if report.engine_running == running:
            break
    return report


async def test_a_request_for_n_samples_is_not_reported_as_other_requests(bus, agents):
    """The engine runs (and counts running) each of n samples; the agent's load report counts them
    as its own, so the routers see no phantom requests beside it."""
    agents("w-n", ["--load-interval", "0.1"])
    await bus.active("w-n")
    rid, sub = await bus.submit("w-n", {**chat(2000, stream=True), "n": 3}, sequences=3)
    assert (await bus.frames(sub, n=2))[-1].kind == "data"
    load_sub = await bus.nc.subscribe(load_subject("w-n"))
    report = await report_running(load_sub, 3)
    assert (report.in_flight, report.engine_running, report.engine_unseen) == (1, 3, 0)
    await load_sub.unsubscribe()
    await bus.nc.publish(cancel_subject("w-n"), encode(Cancel(request_id=rid)))


async def test_pending_limit_is_enforced_by_the_broker(bus, agents):
    agents("w-full", ["--max-pending", "2"])
    await bus.active("w-full")
    long = [await bus.submit("w-full", chat(3000, stream=True)) for _ in range(2)]
    for _, sub in long:
        assert (await bus.frames(sub, n=1))[0].kind == "head"
    load_sub = await bus.nc.subscribe(load_subject("w-full"))
    report = decode(LoadReport, (await load_sub.next_msg(timeout=5)).data)
    assert (report.in_flight, report.by_router) == (2, {ROUTER: 2})  # whose requests they are
    await load_sub.unsubscribe()
    with pytest.raises(ServiceUnavailableError, match="maximum messages"):
        await bus.submit("w-full", chat(3, stream=False))
    for rid, _ in long:
        await bus.nc.publish(cancel_subject("w-full"), encode(Cancel(request_id=rid)))
    assert [await bus.release_of(rid) for rid, _ in long] == [["cancelled"], ["cancelled"]]
    rid, sub = await bus.submit("w-full", chat(3, stream=False))  # room again
    assert [(f.kind, f.status, f.final) for f in await bus.frames(sub)] == [("head", 200, True)]


async def test_cancel_stops_the_generation_in_the_engine(bus, agents):
    agents("w-cancel")
    record = await bus.active("w-cancel")
    rid, sub = await bus.submit("w-cancel", chat(3000, stream=True))
    head, first = await bus.frames(sub, n=2)
    assert (head.kind, first.kind) == ("head", "data")
    assert await eventually_async(lambda: engine_running(record.url), lambda n: n == 1, 5)
    await bus.nc.publish(cancel_subject("w-cancel"), encode(Cancel(request_id=rid)))
    rest = await bus.frames(sub)
    assert rest[-1].kind == "error" and rest[-1].status == 499
    assert await bus.release_of(rid) == ["cancelled"]
    assert await eventually_async(lambda: engine_running(record.url), lambda n: n == 0, 5)


async def eventually_async(probe, accept, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if accept(await probe()):
            return True
        await asyncio.sleep(0.1)
    return False


async def test_sigterm_drains_in_flight_work_then_leaves_and_stops_the_engine(bus, agents):
    agent = agents("w-drain")
    await bus.active("w-drain")
    engine_pid = agent.engine_pid()
    rid, sub = await bus.submit("w-drain", chat(250, stream=True))  # ~1.5 s of decoding
    assert (await bus.frames(sub, n=1))[0].kind == "head"
    os.kill(agent.pid, signal.SIGTERM)
    assert await eventually(lambda: (r := bus.watcher.view.get("w-drain")) is not None
                            and r.status == WorkerStatus.DRAINING, 5)
    with pytest.raises(BadRequestError, match="sealed"):  # raced in: the broker refuses it, not run
        await bus.submit("w-drain", chat(3, stream=False))
    frames = await bus.frames(sub)
    assert frames[-1].kind == "end"  # the in-flight request finished
    assert await bus.release_of(rid) == ["ok"]
    assert await asyncio.to_thread(agent.wait, 20) == 0
    assert bus.watcher.view.get("w-drain") is None
    assert [c.kind for c in bus.changes if c.record.worker_id == "w-drain"][-1] == "leave"
    assert not alive(engine_pid) and not group_members(engine_pid)
    with pytest.raises(NotFoundError):
        await bus.js.stream_info(request_stream("w-drain"))


async def test_engine_death_deregisters_fails_in_flight_and_exits_nonzero(bus, agents):
    agent = agents("w-crash", ttl=6.0)
    await bus.active("w-crash")
    engine_pid = agent.engine_pid()
    rid, sub = await bus.submit("w-crash", chat(3000, stream=True))
    assert (await bus.frames(sub, n=2))[1].kind == "data"
    t0 = time.monotonic()
    os.kill(engine_pid, signal.SIGKILL)
    frames = await bus.frames(sub)
    assert frames[-1].kind == "error" and frames[-1].status == 502
    assert await bus.release_of(rid) == ["error"]
    assert await eventually(lambda: bus.watcher.view.get("w-crash") is None, 5)
    assert time.monotonic() - t0 < 6.0  # deleted at once, not aged out
    assert await asyncio.to_thread(agent.wait, 20) == 128 + signal.SIGKILL
    assert agent.event("engine_exited") is not None


async def test_every_envelope_stored_for_a_worker_whose_engine_dies_gets_an_answer(bus, agents):
    """A router that has not yet heard the worker left keeps publishing to its queue: whatever the
    broker stored is answered (run before the death, or refused after it) and the rest is refused at
    publish time, so no client waits for its upstream timeout."""
    agent = agents("w-flood", ttl=6.0)
    await bus.active("w-flood")
    engine_pid = agent.engine_pid()
    prefix = bus.nc.new_inbox()
    answers: dict[str, Frame] = {}

    async def on_frame(msg):
        frame = decode(Frame, msg.data)
        if frame.kind in ("end", "error") or frame.final:
            answers[msg.subject[len(prefix) + 1:]] = frame

    await bus.nc.subscribe(prefix + ".*", cb=on_frame)
    stored: list[str] = []
    refused: list[str] = []

    async def flood() -> None:
        n = 0
        while agent.proc.poll() is None:
            n += 1
            rid = f"flood-{n}"
            env = WorkEnvelope(request_id=rid, endpoint="/v1/chat/completions",
                               body=json.dumps(chat(1, stream=False)).encode(), stream=False,
                               reply_subject=f"{prefix}.{rid}", deadline=time.time() + 60,
                               lease_id=f"lease-{rid}", router_id=ROUTER)
            try:
                await bus.js.publish(work_subject("w-flood"), encode(env), timeout=2)
                stored.append(rid)
            except Exception as exc:  # sealed (10109) or no stream: the router tries another worker
                refused.append(f"{rid}: {exc}")
                await asyncio.sleep(0.001)

    flooding = asyncio.create_task(flood())
    await asyncio.sleep(0.3)
    os.kill(engine_pid, signal.SIGKILL)
    # under the flood every broker call of the agent's way out (seal, settle, stream delete) may run
    # into its own bounded wait: this test is about the answers, so it allows their sum, not 20 s
    code = await asyncio.to_thread(agent.wait, 60)
    assert code == 128 + signal.SIGKILL, agent.err_path.read_text()[-4000:]
    await flooding
    await eventually(lambda: all(rid in answers for rid in stored), 5)
    unanswered = [rid for rid in stored if rid not in answers]
    assert unanswered == [], f"{len(unanswered)} of {len(stored)} stored envelopes never answered"
    # the rest was refused at publish time: the queue sealed (10109), gone, or full (10077); or the
    # broker, busy deleting the queue, did not answer within the publish timeout (the router then
    # answers 503 at once: it cannot know whether the envelope was stored)
    other = [r for r in refused
             if not any(why in r for why in ("10109", "no response from stream", "10077", "nats: timeout"))]
    assert refused and other == [], other[:3]
    statuses = {(f.kind, f.status) for f in answers.values()}
    assert statuses <= {("head", 200), ("error", 502), ("error", 503)}, statuses


async def test_a_hung_engine_is_registered_unhealthy_gets_no_work_and_comes_back_when_it_answers(bus, agents):
    agent = agents("w-hang", ["--health-check-interval", "0.2", "--health-check-timeout", "0.5",
                              "--health-check-failures", "2"])
    model = (await bus.active("w-hang")).model
    engine_pid = agent.engine_pid()
    os.kill(engine_pid, signal.SIGSTOP)  # alive, sockets open, answering nothing: what a wedged engine looks like
    try:
        assert await eventually(lambda: (r := bus.watcher.view.get("w-hang")) is not None
                                and r.status == WorkerStatus.UNHEALTHY, 10)
        assert agent.event("engine_unhealthy", timeout=5) is not None  # logged after the status is put
        assert bus.watcher.view.active(model) == []  # routers send it nothing new
    finally:
        os.kill(engine_pid, signal.SIGCONT)
    await bus.active("w-hang", timeout=10)  # the next probe passes: routable again
    assert agent.event("engine_healthy_again", timeout=5) is not None
    rid, sub = await bus.submit("w-hang", chat(3, stream=False))
    assert (await bus.frames(sub))[0].status == 200
    os.kill(agent.pid, signal.SIGTERM)
    assert await asyncio.to_thread(agent.wait, 20) == 0


async def agent_metric(port: int, name: str, *having: str) -> float:
    """The sum of the samples whose line starts with ``name`` and holds every one of ``having``."""
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/metrics") as resp:
        text = await resp.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and all(h in line for h in having))


async def test_a_hung_gpu_behind_a_passing_health_check_is_found_by_the_canary(bus, agents):
    """vLLM's /health answers 200 while the GPU hangs; the agent still stops the routing to it."""
    metrics_port = free_port()
    agent = agents("w-stall", ["--health-check-interval", "0.3", "--health-check-timeout", "1",
                               "--load-interval", "0.1", "--metrics-port", str(metrics_port)],
                   ["--engine-flavor", "vllm"])
    record = await bus.active("w-stall")
    model = record.model
    assert record.clamps_max_tokens  # as vLLM does: frontends let prompt + max_tokens past the context through
    rid, sub = await bus.submit("w-stall", chat(600, stream=True, model=model))  # ~3.4 s of tokens
    first = await bus.frames(sub, n=2)
    assert first[-1].kind == "data", first
    await asyncio.sleep(1.0)  # busy and making progress: no canary, still active
    assert bus.watcher.view.get("w-stall").status == WorkerStatus.ACTIVE
    assert await agent_metric(metrics_port, "infera_agent_engine_canaries_total") == 0
    engine_pid = agent.engine_pid()
    engine_url = bus.watcher.view.get("w-stall").url
    os.kill(engine_pid, signal.SIGUSR1)  # the mock's simulated GPU hang
    try:
        assert await eventually(lambda: bus.watcher.view.get("w-stall").status == WorkerStatus.UNHEALTHY, 10)
        async with aiohttp.ClientSession() as s, s.get(f"{engine_url}/health") as resp:
            assert resp.status == 200  # what vLLM's /health says of a hung GPU
    finally:
        os.kill(engine_pid, signal.SIGUSR2)
    stalled = agent.event("engine_stalled")
    assert stalled is not None and stalled["requests"] >= 1
    assert bus.watcher.view.active(model) == []
    assert await agent_metric(metrics_port, 'infera_agent_engine_canaries_total{outcome="silent"') >= 1
    await bus.active("w-stall", timeout=10)  # tokens flow again: routable again
    frames = await bus.frames(sub, timeout=30)  # the stream under way was kept and ends whole
    assert frames[-1].kind == "end"
    os.kill(agent.pid, signal.SIGTERM)
    assert await asyncio.to_thread(agent.wait, 20) == 0


async def test_long_requests_on_an_engine_that_counts_tokens_at_the_end_pass_their_canaries(bus, agents):
    """SGLang's token counters move only when a request ends: while long ones run, the agent sends
    canaries, the engine answers them within a step, and the worker stays active throughout."""
    metrics_port = free_port()
    agents("w-long", ["--health-check-interval", "0.3", "--health-check-timeout", "2",
                      "--load-interval", "0.1", "--metrics-port", str(metrics_port)])  # the sglang flavour
    model = (await bus.active("w-long")).model
    rid, sub = await bus.submit("w-long", chat(500, stream=True, model=model))  # ~3 s of tokens
    statuses = set()
    frames: list = []
    collect = asyncio.create_task(bus.frames(sub, timeout=30))
    while not collect.done():
        statuses.add(bus.watcher.view.get("w-long").status)
        await asyncio.sleep(0.05)
    frames = collect.result()
    assert frames[-1].kind == "end"
    assert statuses == {WorkerStatus.ACTIVE}
    sent = await agent_metric(metrics_port, "infera_agent_engine_canaries_total")
    silent = await agent_metric(metrics_port, 'infera_agent_engine_canaries_total{outcome="silent"')
    assert sent >= 1 and silent == 0


async def test_a_gpu_that_hangs_while_idle_is_found_before_a_request_meets_it(bus, agents):
    """An idle engine gets a one-token completion every --engine-idle-canary-after seconds; when it
    goes unanswered the worker leaves routing with no request having waited on it, and stays out
    (tested every round) until the engine answers again."""
    metrics_port = free_port()
    agent = agents("w-idle", ["--health-check-interval", "0.3", "--health-check-timeout", "1",
                              "--engine-idle-canary-after", "1", "--load-interval", "0.1",
                              "--metrics-port", str(metrics_port)], ["--engine-flavor", "vllm"])
    model = (await bus.active("w-idle")).model
    idle_answered = 'infera_agent_engine_canaries_total{outcome="answered",reason="idle"}'
    assert await eventually_async(lambda: agent_metric(metrics_port, idle_answered), lambda n: n >= 1, 10)
    assert bus.watcher.view.get("w-idle").status == WorkerStatus.ACTIVE
    engine_pid = agent.engine_pid()
    os.kill(engine_pid, signal.SIGUSR1)
    try:
        assert await eventually(lambda: bus.watcher.view.get("w-idle").status == WorkerStatus.UNHEALTHY, 10)
        stalled = agent.event("engine_stalled")
        assert stalled is not None and stalled["reason"] == "idle" and stalled["requests"] == 0
        statuses = set()
        for _ in range(40):  # ~6 health rounds: still tested, still out
            statuses.add(bus.watcher.view.get("w-idle").status)
            await asyncio.sleep(0.1)
        assert statuses == {WorkerStatus.UNHEALTHY}
        assert await agent_metric(metrics_port, 'infera_agent_engine_canaries_total{outcome="silent",reason="suspect"}') >= 1
    finally:
        os.kill(engine_pid, signal.SIGUSR2)
    await bus.active("w-idle", timeout=10)
    rid, sub = await bus.submit("w-idle", chat(3, stream=False, model=model))
    frames = await bus.frames(sub)
    assert frames[-1].final and frames[-1].status == 200


async def test_an_engine_whose_health_generates_gets_no_idle_canary(bus, agents):
    """SGLang's /health runs a generation on every probe (uncounted in its metrics): the probes
    already test an idle engine, so the agent adds no canary of its own, which would show as traffic."""
    metrics_port = free_port()
    agents("w-deep", ["--health-check-interval", "0.2", "--engine-idle-canary-after", "0.3",
                      "--load-interval", "0.1", "--metrics-port", str(metrics_port)])  # the sglang flavour
    await bus.active("w-deep")
    await asyncio.sleep(3.0)  # ~15 idle rounds, each of which would send a vLLM a canary
    assert await agent_metric(metrics_port, "infera_agent_engine_canaries_total", 'reason="idle"') == 0
    assert bus.watcher.view.get("w-deep").status == WorkerStatus.ACTIVE


async def test_sigkilled_agent_takes_its_engine_along_and_ages_out(bus, agents):
    agent = agents("w-kill")
    await bus.active("w-kill")
    engine_pid = agent.engine_pid()
    assert alive(engine_pid)
    t0 = time.monotonic()
    os.kill(agent.pid, signal.SIGKILL)
    assert await eventually(lambda: not alive(engine_pid) and not group_members(engine_pid), 5)
    assert await eventually(lambda: bus.watcher.view.get("w-kill") is None, 2.0 + 2.0)
    assert time.monotonic() - t0 <= 4.0
    assert await eventually(lambda: not alive(agent.watchdog_pid()), 5)


async def test_a_second_agent_given_a_live_agents_worker_id_exits_2_before_launching_its_engine(bus, agents):
    """One runbook line on two nodes: the second agent is refused in seconds, and the first keeps its entry
    (the second used to overwrite it, and take it along when it stopped)."""
    first = agents("w-twice")
    record = await bus.active("w-twice")
    second = agents("w-twice")
    assert second.wait(15) == 2
    refused = second.event("worker_id_taken")
    assert refused is not None and f"its engine at {record.url}" in refused["error"]
    assert "give every agent its own --worker-id" in refused["error"]
    assert second.event("engine_spawned") is None
    await asyncio.sleep(2.5)  # longer than the ttl: the first agent's entry is still there, unchanged
    current = bus.watcher.view.get("w-twice")
    assert current is not None and (current.url, current.started_at) == (record.url, record.started_at)
    assert first.proc.poll() is None


async def test_drain_timeout_cancels_what_is_left_and_still_exits_0(bus, agents):
    agent = agents("w-slowdrain", ["--drain-timeout", "0.5"])
    await bus.active("w-slowdrain")
    rid, sub = await bus.submit("w-slowdrain", chat(3000, stream=True))
    assert (await bus.frames(sub, n=2))[1].kind == "data"
    os.kill(agent.pid, signal.SIGTERM)
    frames = await bus.frames(sub)
    assert frames[-1].kind == "error" and frames[-1].status == 503
    assert await bus.release_of(rid) == ["cancelled"]
    assert await asyncio.to_thread(agent.wait, 20) == 0
    assert agent.event("drain_incomplete_cancelled")["cancelled"] == 1
