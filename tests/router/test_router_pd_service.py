"""Disaggregated serving and session affinity through the router service: real nats-server, fake
workers (their work queues and discovery records), the router's own envelopes, releases and cancels."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from infera_common.nats_conn import flush_all
from infera_common.schemas import Cancel, Frame, PdParams, Release, Role, decode, encode
from infera_common.subjects import cancel_subject, router_release_subject

from test_router_service import bench, eventually  # noqa: F401  (the fixture)

SGLANG = PdParams(protocol="sglang-bootstrap", bootstrap_port=8998)


async def pd_fleet(bench, protocol: PdParams = SGLANG) -> None:
    await bench.worker("p1", role=Role.PREFILL, pd=protocol)
    await bench.worker("d1", role=Role.DECODE, pd=protocol)


async def cancels(bench, wid: str) -> list:
    got: list[str] = []

    async def on(msg):
        cancel = decode(Cancel, msg.data)
        got.append(cancel.request_id)
        bench.cancel_statuses = [*getattr(bench, "cancel_statuses", []), (cancel.status, cancel.message)]
        bench.cancel_failed = [*getattr(bench, "cancel_failed", []), cancel.failed_worker]

    await bench.nc.subscribe(cancel_subject(wid), cb=on)
    await flush_all(bench.nc)
    return got


async def release(bench, lease_id: str, wid: str, outcome: str) -> None:
    await bench.nc.publish(router_release_subject("rt1"), encode(Release(lease_id=lease_id, worker_id=wid, outcome=outcome)))


def body(env) -> dict:
    return json.loads(env.body)


async def test_a_pair_gets_both_legs_with_the_same_room_and_the_client_reads_the_decode(bench):
    await pd_fleet(bench)
    reply = await bench.route(request_id="q1", prompt_tokens=10, body=b'{"prompt": "hi", "stream": true}', stream=True)
    assert reply.status == 200 and reply.worker_id == "d1"
    [pre], [dec] = await bench.pull("p1"), await bench.pull("d1")
    assert body(pre)["bootstrap_room"] == body(dec)["bootstrap_room"]
    assert (body(pre)["bootstrap_host"], body(pre)["bootstrap_port"]) == ("127.0.0.1", 8998)
    assert pre.reply_subject.startswith("infera.router.pd.rt1.") and not pre.stream and body(pre)["stream"] is False
    assert dec.reply_subject == "_INBOX.test.1" and dec.stream and dec.lease_id == reply.lease_id
    assert bench.leases("p1") == bench.leases("d1") == 1
    assert bench.metric("infera_router_pd_pairs_total") == 1


async def test_hold_keeps_prefill_load_until_decode_finishes(bench):
    await pd_fleet(bench)
    reply = await bench.route(request_id="q1", prompt_tokens=10)
    [pre] = await bench.pull("p1")
    await bench.nc.publish(pre.reply_subject, encode(Frame(kind="head", seq=0, status=200, body=b"{}", final=True)))
    await release(bench, pre.lease_id, "p1", "ok")
    await eventually(lambda: bench.metric("infera_router_lease_releases_total", outcome="ok") >= 1)
    assert bench.leases("p1") == 1  # held: the decode has not finished
    await release(bench, reply.lease_id, "d1", "ok")
    await eventually(lambda: bench.leases("p1") == 0 and bench.leases("d1") == 0)


@pytest.mark.parametrize("bench", [{"pd_prefill_guard_release": "completion"}], indirect=True)
async def test_completion_releases_prefill_load_when_its_answer_is_drained_not_on_headers(bench):
    await pd_fleet(bench)
    await bench.route(request_id="q1", prompt_tokens=10, stream=True)
    [pre] = await bench.pull("p1")
    await bench.nc.publish(pre.reply_subject, encode(Frame(kind="head", seq=0, status=200)))  # headers only
    await bench.nc.flush()
    await asyncio.sleep(0.2)  # the router has read the head frame
    assert bench.leases("p1") == 1
    await bench.nc.publish(pre.reply_subject, encode(Frame(kind="end", seq=1)))
    await eventually(lambda: bench.leases("p1") == 0)
    assert bench.leases("d1") == 1  # decode keeps its own


async def test_a_failed_decode_cancels_the_prefill_leg_and_leaves_no_lease(bench):
    await pd_fleet(bench)
    stopped = await cancels(bench, "p1")
    reply = await bench.route(request_id="q1", prompt_tokens=10)
    await release(bench, reply.lease_id, "d1", "error")
    await eventually(lambda: stopped == ["q1"])
    assert bench.leases("p1") == bench.leases("d1") == 0
    assert len(bench.router.pairs) == 0


async def test_a_failed_prefill_drain_cancels_the_decode_leg(bench):
    await pd_fleet(bench)
    stopped = await cancels(bench, "d1")
    await bench.route(request_id="q1", prompt_tokens=10)
    [pre] = await bench.pull("p1")
    await bench.nc.publish(pre.reply_subject, encode(Frame(kind="error", seq=0, status=500, message="boom")))
    await eventually(lambda: stopped == ["q1"])
    # the client reads the decode leg: it must see a server failure, not its own cancellation
    assert bench.cancel_statuses == [(502, "the prefill leg of this disaggregated request failed on worker p1: boom")]
    assert bench.cancel_failed == ["p1"]  # the requester's retry avoids p1, not d1
    assert bench.leases("p1") == 0  # the failed prefill is released at once
    assert bench.metric("infera_router_pd_leg_failures_total", leg="prefill") == 1


async def test_a_prefill_that_refuses_the_prompt_gives_the_client_its_400_and_trips_no_breaker(bench):
    """The prompt too long for the model: the prefill engine's 400 is the client's answer (it raced a
    502 'prefill leg failed' before), and the worker's circuit breaker does not count it."""
    await pd_fleet(bench)
    stopped = await cancels(bench, "d1")
    refusal = b'{"object": "error", "message": "the prompt has 9031 tokens; the limit is 8192", "code": 400}'
    for i in range(4):  # more than the breaker's failures in a row
        await bench.route(request_id=f"long{i}", prompt_tokens=10)
        [pre] = await bench.pull("p1")
        await bench.nc.publish(pre.reply_subject, encode(Frame(kind="head", seq=0, status=400, body=refusal,
                                                               final=True)))
        await eventually(lambda: len(stopped) == i + 1)
    assert set(bench.cancel_statuses) == {(400, "the prompt has 9031 tokens; the limit is 8192")}
    state = bench.router.core.breaker.snapshot(time.monotonic()).get("p1")
    assert state is None or state.state.value == "closed"  # (three such refusals used to open it)


async def test_a_vanished_decode_worker_stops_the_prefill_leg(bench):
    await pd_fleet(bench)
    stopped = await cancels(bench, "p1")
    await bench.route(request_id="q1", prompt_tokens=10)
    await bench.registrars.pop("d1").stop()
    await eventually(lambda: stopped == ["q1"], timeout=15)
    assert bench.leases("p1") == 0


async def test_only_one_pool_is_503_naming_the_missing_one(bench):
    await bench.worker("p1", role=Role.PREFILL, pd=SGLANG)
    reply = await bench.route(request_id="q1")
    assert reply.status == 503 and "no active decode worker" in reply.message


async def test_vllm_pairs_send_the_decode_only_after_the_prefill_answered(bench):
    vllm = PdParams(protocol="vllm-mooncake", bootstrap_host="10.1.1.1", bootstrap_port=8998, engine_id="e-p1")
    await pd_fleet(bench, vllm)
    route = bench.route(request_id="q1", prompt_tokens=10, body=b'{"prompt": "hi", "max_tokens": 9}')

    pending = asyncio.create_task(route)
    await eventually(lambda: bench.leases("p1") == 1)
    assert bench.leases("d1") == 0 and not pending.done()
    [pre] = await bench.pull("p1")
    assert body(pre)["max_tokens"] == 1 and body(pre)["kv_transfer_params"]["do_remote_decode"] is True
    await bench.nc.publish(pre.reply_subject, encode(Frame(kind="head", seq=0, status=200, body=b"{}", final=True)))
    reply = await pending
    assert reply.status == 200 and reply.worker_id == "d1"
    [dec] = await bench.pull("d1")
    params = body(dec)["kv_transfer_params"]
    assert params["remote_engine_id"] == "e-p1" and params["remote_bootstrap_addr"] == "http://10.1.1.1:8998"
    assert params["transfer_id"] == body(pre)["kv_transfer_params"]["transfer_id"] and body(dec)["max_tokens"] == 9


@pytest.mark.parametrize("status", [502, 503, 429])
async def test_a_vllm_prefill_that_fails_is_tried_on_the_next_prefill_worker(bench, status):
    """Nothing was handed over to a decode yet: the router tries the model's other prefill worker
    instead of failing the request (the requester cannot retry a router's refusal)."""
    vllm = PdParams(protocol="vllm-mooncake", bootstrap_host="10.1.1.1", bootstrap_port=8998, engine_id="e-p")
    await bench.worker("p1", role=Role.PREFILL, pd=vllm)
    await bench.worker("p2", role=Role.PREFILL, pd=vllm)
    await bench.worker("d1", role=Role.DECODE, pd=vllm)
    pending = asyncio.create_task(bench.route(request_id="q1", prompt_tokens=10, body=b'{"prompt": "hi"}'))
    answers = [Frame(kind="error", seq=0, status=status, message="engine gone"),
               Frame(kind="head", seq=0, status=200, body=b"{}", final=True)]
    tried = []
    for answer in answers:
        got = []
        for _ in range(20):  # each pull waits up to 0.5 s
            if got:
                break
            for wid in ("p1", "p2"):
                if wid not in tried and (envs := await bench.pull(wid)):
                    got = [(wid, envs[0])]
                    break
        wid, pre = got[0]
        tried.append(wid)
        await bench.nc.publish(pre.reply_subject, encode(answer))
    reply = await pending
    assert reply.status == 200 and reply.worker_id == "d1"
    assert sorted(tried) == ["p1", "p2"]
    await eventually(lambda: bench.leases(tried[0]) == 0)  # the failed prefill's lease is released


async def test_a_vllm_prefill_failing_on_every_prefill_worker_gives_the_last_failure(bench):
    vllm = PdParams(protocol="vllm-mooncake", bootstrap_host="10.1.1.1", bootstrap_port=8998, engine_id="e-p1")
    await pd_fleet(bench, vllm)
    pending = asyncio.create_task(bench.route(request_id="q1", prompt_tokens=10, body=b'{"prompt": "hi"}'))
    [pre] = await bench.pull("p1")
    await bench.nc.publish(pre.reply_subject, encode(Frame(kind="error", seq=0, status=503, message="draining")))
    reply = await pending
    assert reply.status == 503 and reply.message == "prefill worker p1 failed: draining"
    assert bench.leases("d1") == 0


async def test_a_long_vllm_prefill_keeps_its_requester_waiting_up_to_its_upstream_timeout(bench):
    # the route reply needs the prefill's answer (it names the decode worker): a prefill longer than
    # the requester's route timeout is said to be alive, and waited for up to its upstream timeout
    vllm = PdParams(protocol="vllm-mooncake", bootstrap_host="10.1.1.1", bootstrap_port=8998, engine_id="e-p1")
    await pd_fleet(bench, vllm)
    heard: list[Frame] = []

    async def hear(msg):
        heard.append(decode(Frame, msg.data))

    sub = await bench.nc.subscribe("_INBOX.test.1", cb=hear)
    await flush_all(bench.nc)
    pending = asyncio.create_task(bench.route(request_id="q1", prompt_tokens=10, body=b'{"prompt": "hi"}',
                                              keepalive=0.1, upstream_timeout=30))
    await eventually(lambda: len(heard) >= 3)  # ~0.3 s of prefill
    assert {(f.kind, f.seq) for f in heard} == {("alive", 0)} and not pending.done()
    [pre] = await bench.pull("p1")
    await bench.nc.publish(pre.reply_subject, encode(Frame(kind="head", seq=0, status=200, body=b"{}", final=True)))
    reply = await pending
    assert reply.status == 200 and reply.worker_id == "d1"
    count = len(heard)
    await asyncio.sleep(0.3)
    assert len(heard) == count  # no more once the prefill answered
    await release(bench, pre.lease_id, "p1", "ok")
    await release(bench, reply.lease_id, "d1", "ok")
    await eventually(lambda: bench.leases("p1") == 0 and bench.leases("d1") == 0)

    gone = await cancels(bench, "p1")
    reply = await bench.route(request_id="q2", prompt_tokens=10, body=b'{"prompt": "hi"}',
                              keepalive=0.1, upstream_timeout=0.5)  # the prefill never answers
    assert reply.status == 504 and "no prefill answer within 0.5s" in reply.message
    await eventually(lambda: gone == ["q2"])  # its prefill leg is stopped, its lease given back
    await eventually(lambda: bench.leases("p1") == 0 and bench.leases("d1") == 0)
    await sub.unsubscribe()


# --- session affinity ----------------------------------------------------------------------------
BOTH = {"session_affinity": "both"}


@pytest.mark.parametrize("bench", [BOTH], indirect=True)
async def test_a_session_stays_on_its_worker_and_requests_without_it_route_normally(bench):
    await bench.worker("a")
    await bench.worker("b")
    first = await bench.route(request_id="s1-1", session_ids=["s1"])
    again = [await bench.route(request_id=f"s1-{i}", session_ids=["s1"]) for i in range(2, 5)]
    assert {r.worker_id for r in again} == {first.worker_id}
    plain = [await bench.route(request_id=f"x{i}") for i in range(2)]
    assert {r.worker_id for r in plain} == {"a", "b"}  # round-robin goes on for the rest
    assert bench.metric("infera_router_session_hits_total", role="aggregated") == 0  # exported by the sweeper


@pytest.mark.parametrize("bench", [BOTH], indirect=True)
@pytest.mark.parametrize("ids,why", [(["s", "s"], "sent 2 times"), ([""], "empty"), (["x" * 1025], "1024")])
async def test_bad_session_ids_are_400(bench, ids, why):
    await bench.worker("a")
    reply = await bench.route(request_id="q", session_ids=ids)
    assert reply.status == 400 and why in reply.message
    assert bench.leases("a") == 0


async def test_affinity_off_ignores_the_header(bench):
    await bench.worker("a")
    await bench.worker("b")
    replies = [await bench.route(request_id=f"q{i}", session_ids=["s", "s"]) for i in range(2)]
    assert [r.status for r in replies] == [200, 200] and {r.worker_id for r in replies} == {"a", "b"}


@pytest.mark.parametrize("bench", [BOTH], indirect=True)
async def test_a_failed_request_unbinds_its_session_and_a_gone_worker_is_reselected(bench):
    await bench.worker("a")
    await bench.worker("b")
    first = await bench.route(request_id="1", session_ids=["s"])
    home = first.worker_id
    await release(bench, first.lease_id, home, "error")
    await eventually(lambda: bench.leases(home) == 0)
    assert bench.router.core.sessions.table.get("m", "s", Role.AGGREGATED) is None
    second = await bench.route(request_id="2", session_ids=["s"])  # the policy picks anew, then binds
    third = await bench.route(request_id="3", session_ids=["s"])
    assert third.worker_id == second.worker_id
    await bench.registrars.pop(second.worker_id).stop()
    await eventually(lambda: bench.router.core.fleet.get(second.worker_id) is None, timeout=15)
    fourth = await bench.route(request_id="4", session_ids=["s"])
    assert fourth.status == 200 and fourth.worker_id != second.worker_id
    fifth = await bench.route(request_id="5", session_ids=["s"])
    assert fifth.worker_id == fourth.worker_id


@pytest.mark.parametrize("bench", [{"session_affinity": "prefill"}], indirect=True)
async def test_prefill_mode_pins_the_prefill_leg_only(bench):
    for wid in ("p1", "p2"):
        await bench.worker(wid, role=Role.PREFILL, pd=SGLANG)
    for wid in ("d1", "d2"):
        await bench.worker(wid, role=Role.DECODE, pd=SGLANG)
    replies = [await bench.route(request_id=f"q{i}", session_ids=["s"]) for i in range(4)]
    prefills = [bench.router.pairs.pair_of(r.lease_id).prefill.worker_id for r in replies]
    assert len(set(prefills)) == 1
    assert {r.worker_id for r in replies} == {"d1", "d2"}  # decode chosen per request


@pytest.mark.parametrize("bench", [BOTH], indirect=True)
async def test_both_mode_pins_prefill_and_decode_independently(bench):
    for wid in ("p1", "p2"):
        await bench.worker(wid, role=Role.PREFILL, pd=SGLANG)
    for wid in ("d1", "d2"):
        await bench.worker(wid, role=Role.DECODE, pd=SGLANG)
    replies = [await bench.route(request_id=f"q{i}", session_ids=["s"]) for i in range(4)]
    assert len({r.worker_id for r in replies}) == 1
    assert len({bench.router.pairs.pair_of(r.lease_id).prefill.worker_id for r in replies}) == 1


async def test_both_legs_of_a_pair_carry_the_requests_trace_context_to_their_engines(bench):
    await pd_fleet(bench)
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    reply = await bench.route(request_id="q-trace", prompt_tokens=10, body=b'{"prompt": "hi"}', traceparent=parent)
    assert reply.status == 200
    [pre], [dec] = await bench.pull("p1"), await bench.pull("d1")
    # tracing is off in this process: the router's span passes the frontend's context on unchanged
    assert pre.headers["traceparent"] == dec.headers["traceparent"] == parent
