"""--kv-index local: the router replays and follows the KV event stream itself and routes on its own
copy of the index, against a real nats-server, with no kv-indexer at all."""

from __future__ import annotations

import time

import pytest

from infera_common.discovery import Registrar
from infera_common.kv_index.index import UNATTACHED_GRACE
from infera_common.nats_conn import connect, ensure_kv_event_stream, ensure_request_stream
from infera_common.schemas import RouteReply, decode, encode
from infera_common.settings import parse_cli
from infera_common.subjects import KV_QUERY, ROUTER_ROUTE

from infera_router.service import RouterService
from infera_router.settings import RouterSettings

from router_helpers import route_request
from test_router_service import eventually
from tests.kv_indexer.kv_fakes import MODEL, FakeEngine, record, tokens

SYSTEM = tokens(40)  # 10 blocks of 4
CHAT_A = SYSTEM + tokens(12, start=5000)
CHAT_B = SYSTEM + tokens(12, start=6000)


@pytest.fixture
async def fleet(nats_server):
    """Two registered workers (a, b), an observer connection that counts kv-indexer queries, and a
    factory for routers on --kv-index local."""
    nc = await connect(nats_server, "kv-local-test")
    js = nc.jetstream()
    await ensure_kv_event_stream(js)  # as the worker-agents do before relaying
    queries: list[bytes] = []

    async def indexer(msg):
        queries.append(msg.data)

    await nc.subscribe(KV_QUERY, cb=indexer)
    regs = {}
    for wid in ("a", "b"):
        await ensure_request_stream(js, wid, 20, max_age=60)
        regs[wid] = Registrar(js, record(wid).model_copy(update={"max_pending": 20}))
        await regs[wid].start()
    routers: list[RouterService] = []

    async def router(**kw) -> RouterService:
        r = RouterService(RouterSettings(nats_url=nats_server, router_id=f"local{len(routers)}", kv_index="local",
                                         **kw))
        await r.start()
        routers.append(r)
        await eventually(lambda: len(r.core.fleet.active(MODEL)) == 2)
        return r

    yield nc, router, regs, queries
    for r in routers:
        await r.stop()
    for reg in regs.values():
        await reg.stop()
    await nc.close()


async def route(nc, rid: str, ids: list[int]) -> RouteReply:
    req = route_request(model=MODEL, request_id=rid, token_ids=ids, prompt_tokens=len(ids))
    return decode(RouteReply, (await nc.request(ROUTER_ROUTE, encode(req), timeout=5)).data)


def metric(router, name: str, **labels) -> float:
    return router.metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.mark.parametrize("relay_kind", ["blocks", "batch"])
async def test_history_replayed_at_start_and_events_followed_after_decide_the_pick(fleet, relay_kind):
    nc, router, _, queries = fleet
    engines = {wid: FakeEngine(wid) for wid in ("a", "b")}
    for e in engines.values():
        e.relay_kind = relay_kind  # as the worker-agent relays (blocks) or raw engine batches
    js = nc.jetstream()
    await js.publish(engines["b"].subject, engines["b"].relay(engines["b"].stored(CHAT_B)))  # before the router
    r = await router()
    assert metric(r, "infera_router_kv_index_messages_total", outcome="applied") == 1  # replayed at start
    assert metric(r, "infera_router_kv_index_replaying") == 0
    first = await route(nc, "r1", CHAT_B)
    assert (first.status, first.worker_id) == (200, "b")
    await js.publish(engines["a"].subject, engines["a"].relay(engines["a"].stored(CHAT_A)))  # while it runs
    await eventually(lambda: metric(r, "infera_router_kv_index_messages_total", outcome="applied") == 2)
    second = await route(nc, "r2", CHAT_A)
    assert (second.status, second.worker_id) == (200, "a")
    assert metric(r, "infera_router_kv_hit_blocks_sum") == 2 * 12  # every full block but the last (52 tokens)
    assert queries == []  # no kv-indexer was asked


async def test_a_worker_leaving_discovery_leaves_the_answers_and_its_blocks_go_after_the_grace(fleet):
    nc, router, regs, _ = fleet
    b = FakeEngine("b")
    await nc.jetstream().publish(b.subject, b.relay(b.stored(CHAT_B)))
    r = await router()
    assert (await route(nc, "r1", CHAT_B)).worker_id == "b"
    await regs.pop("b").stop()
    await eventually(lambda: len(r.core.fleet.active(MODEL)) == 1)
    assert (await route(nc, "r2", CHAT_B)).worker_id == "a"
    assert r._local_kv is not None and r._local_kv.index.held(MODEL, ["b"]) == []
    assert r._local_kv.index.worker_blocks("b") > 0  # kept, should it come back with its cache
    assert r._local_kv.index.expire_unattached(time.time() + UNATTACHED_GRACE + 1, UNATTACHED_GRACE) == ["b"]


async def test_a_malformed_stream_message_is_counted_and_the_router_keeps_routing(fleet):
    nc, router, _, _ = fleet
    r = await router()
    await nc.jetstream().publish(FakeEngine("a").subject, b"\xc1 not msgpack")
    await eventually(lambda: metric(r, "infera_router_kv_index_messages_total", outcome="malformed") == 1)
    assert (await route(nc, "r1", CHAT_A)).status == 200


def test_a_local_index_without_the_event_stream_is_refused_at_start_with_the_fix():
    with pytest.raises(SystemExit) as exit_:
        parse_cli(RouterSettings, ["--kv-index", "local", "--kv-event-transport", "zmq",
                                   "--discovery-backend", "etcd", "--etcd-endpoint", "127.0.0.1:2379"], prog="router")
    assert exit_.value.code == 2
