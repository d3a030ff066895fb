"""Circuit breakers fed by the worker-agents' releases, through the router service (real nats-server)."""

from __future__ import annotations

import asyncio

import pytest

from infera_common.schemas import Release, encode
from infera_common.subjects import router_release_subject

from test_router_service import bench, eventually  # noqa: F401  (the fixture)

FAST = {"breaker_failure_threshold": 3, "breaker_cooldown_s": 0.5, "breaker_max_cooldown_s": 2.0}


async def fail(bench, reply, outcome: str = "error") -> None:
    await bench.nc.publish(router_release_subject("rt1"),
                           encode(Release(lease_id=reply.lease_id, worker_id=reply.worker_id, outcome=outcome)))
    await eventually(lambda: bench.router.core.leases.get(reply.lease_id) is None)


async def to(bench, wid: str, rid: str):
    """Route requests until one lands on ``wid`` (round-robin alternates)."""
    for i in range(4):
        reply = await bench.route(request_id=f"{rid}-{i}")
        if reply.worker_id == wid:
            return reply
        await fail(bench, reply, "ok")
    raise AssertionError(f"no request reached {wid}")


@pytest.mark.parametrize("bench", [FAST], indirect=True)
async def test_three_faults_open_the_breaker_then_one_probe_closes_it(bench):
    await bench.worker("a")
    await bench.worker("b")
    for i in range(3):
        await fail(bench, await to(bench, "a", f"f{i}"))
    assert bench.metric("infera_router_breaker_trips_total", worker="a") == 1
    assert bench.metric("infera_router_breaker_state", worker="a") == 2  # open
    replies = [await bench.route(request_id=f"x{i}") for i in range(4)]
    assert {r.worker_id for r in replies} == {"b"}  # a sits out its cooldown
    for r in replies:
        await fail(bench, r, "ok")
    await asyncio.sleep(0.6)
    probe = await to(bench, "a", "probe")  # half-open: one probe goes to a
    other = await bench.route(request_id="during-probe")
    assert other.worker_id == "b"  # only one probe at a time
    await fail(bench, probe, "ok")
    assert bench.metric("infera_router_breaker_state", worker="a") == 0  # closed again
    await fail(bench, other, "ok")
    assert {(await bench.route(request_id=f"y{i}")).worker_id for i in range(2)} == {"a", "b"}


@pytest.mark.parametrize("bench", [FAST], indirect=True)
async def test_client_errors_and_cancellations_never_count(bench):
    await bench.worker("a")
    for i in range(5):  # 4xx/429 answers are released "ok" by the agent; a client leaving is "cancelled"
        await fail(bench, await bench.route(request_id=f"c{i}"), "cancelled" if i % 2 else "ok")
    assert bench.metric("infera_router_breaker_trips_total", worker="a") == 0


@pytest.mark.parametrize("bench", [FAST], indirect=True)
async def test_when_every_breaker_is_open_the_request_is_routed_anyway(bench):
    await bench.worker("a")
    for i in range(3):
        await fail(bench, await bench.route(request_id=f"f{i}"))
    reply = await bench.route(request_id="anyway")
    assert reply.status == 200 and reply.worker_id == "a"
    assert bench.metric("infera_router_breaker_all_open_total", model="m") == 1
