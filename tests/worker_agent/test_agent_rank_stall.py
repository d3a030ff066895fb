"""One data-parallel rank hangs while the others work (plain DP: each rank its own scheduler and
GPU). The engine's counters keep moving and vLLM's /health passes, so only the agent's per-rank
view finds it: a whole health round in which the requests pinned to that rank got no frame, then a
one-token completion pinned to the rank that goes unanswered."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

from infera.procs import free_port
from infera_common.dp_pin import pin_body, rank_headers
from infera_common.schemas import Frame, WorkEnvelope, WorkerStatus, decode, encode
from infera_common.subjects import work_subject

from .test_agent_process import ROUTER, agent_metric, agents, bus, chat, eventually  # noqa: F401  (fixtures)


async def submit_pinned(bus, worker_id: str, rid: str, body: dict, rank: int):
    """A work envelope pinned to one DP rank, as the router sends it (body field and header)."""
    inbox = bus.nc.new_inbox()
    sub = await bus.nc.subscribe(inbox)
    env = WorkEnvelope(request_id=rid, endpoint="/v1/chat/completions", body=json.dumps(pin_body(body, rank)).encode(),
                       stream=bool(body.get("stream")), reply_subject=inbox, deadline=time.time() + 120,
                       lease_id=f"lease-{rid}", router_id=ROUTER, headers=rank_headers(rank))
    await bus.js.publish(work_subject(worker_id), encode(env))
    return sub


async def test_one_hung_dp_rank_among_working_ones_takes_the_worker_out_of_routing(bus, agents):
    metrics_port = free_port()
    agent = agents("w-dp", ["--health-check-interval", "0.3", "--health-check-timeout", "1", "--load-interval", "0.1",
                            "--metrics-port", str(metrics_port)],
                   ["--engine-flavor", "vllm", "--dp-size", "2", "--hang-ranks", "1"])
    model = (await bus.active("w-dp")).model
    working = await submit_pinned(bus, "w-dp", "on-rank-0", chat(6000, stream=True, model=model), 0)
    assert decode(Frame, (await working.next_msg(timeout=10)).data).kind == "head"
    engine_pid = agent.engine_pid()
    os.kill(engine_pid, signal.SIGUSR1)  # rank 1's GPU hangs; rank 0 goes on
    try:
        stuck = await submit_pinned(bus, "w-dp", "on-rank-1", chat(20, stream=True, model=model), 1)
        assert await eventually(lambda: bus.watcher.view.get("w-dp").status == WorkerStatus.UNHEALTHY, 15)
        stalled = agent.event("engine_stalled")
        assert stalled is not None and stalled["reason"] == "rank" and stalled["dp_rank"] == 1
        assert stalled["requests"] == 1
        # rank 0 kept streaming all along: the engine as a whole never looked stalled
        got = [decode(Frame, (await working.next_msg(timeout=5)).data) for _ in range(20)]
        assert {f.kind for f in got} == {"data"}
        assert await agent_metric(metrics_port, "infera_agent_engine_canaries_total", 'reason="stalled"') == 0
        # the request waiting on the hung rank is handed back, for the frontend to try elsewhere
        frames = []
        while not frames or frames[-1].kind not in ("end", "error"):
            frames.append(decode(Frame, (await stuck.next_msg(timeout=10)).data))
        assert frames[-1].kind == "error" and frames[-1].status == 503
        statuses = set()
        for _ in range(30):  # ~10 health rounds with nothing left on the rank: still tested, still out
            statuses.add(bus.watcher.view.get("w-dp").status)
            await asyncio.sleep(0.1)
        assert statuses == {WorkerStatus.UNHEALTHY}
    finally:
        os.kill(engine_pid, signal.SIGUSR2)
    await bus.active("w-dp", timeout=15)  # the rank answers again: back in routing


async def test_a_dp_rank_that_hangs_while_idle_is_found_by_idle_canaries_that_take_the_ranks_in_turn(bus, agents):
    """vLLM's balancer sends every request of an idle engine to rank 0, an unpinned idle canary
    included: rank 1 hanging while idle was never met. The idle canaries are pinned to each rank in
    turn, and the one after a silent canary stays on its rank (rank 0 answering must not clear it)."""
    agent = agents("w-dp-idle", ["--health-check-interval", "0.3", "--health-check-timeout", "1",
                                 "--engine-idle-canary-after", "0.5", "--load-interval", "0.1"],
                   ["--engine-flavor", "vllm", "--dp-size", "2", "--hang-ranks", "1"])
    model = (await bus.active("w-dp-idle")).model
    engine_pid = agent.engine_pid()
    os.kill(engine_pid, signal.SIGUSR1)  # rank 1's GPU hangs with nothing on it
    try:
        assert await eventually(lambda: bus.watcher.view.get("w-dp-idle").status == WorkerStatus.UNHEALTHY, 15)
        stalled = agent.event("engine_stalled")
        assert stalled is not None and stalled["reason"] == "idle" and stalled["dp_rank"] == 1
        statuses = set()
        for _ in range(30):  # ~10 health rounds: the canary stays on rank 1, the worker stays out
            statuses.add(bus.watcher.view.get("w-dp-idle").status)
            await asyncio.sleep(0.1)
        assert statuses == {WorkerStatus.UNHEALTHY}
    finally:
        os.kill(engine_pid, signal.SIGUSR2)
    await bus.active("w-dp-idle", timeout=15)  # rank 1 answers again: back in routing
    sub = await submit_pinned(bus, "w-dp-idle", "after", chat(3, stream=False, model=model), 1)
    assert decode(Frame, (await sub.next_msg(timeout=10)).data).status == 200
