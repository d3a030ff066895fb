"""The services' own NATS code (frontend inbox and relay, router publisher, kv-indexer query) on the in-process bus."""

from __future__ import annotations

import asyncio

import msgpack
import pytest
from nats.aio.msg import Msg

from infera_common.local_bus import DEFAULT_MAX_PAYLOAD, LocalBus
from infera_common.nats_conn import close_connection, unsubscribe_quietly
from infera_common.schemas import Endpoint, OverlapReply, RouteReply, decode, encode
from infera_common.subjects import KV_INDEXER_QUEUE, KV_QUERY, ROUTER_QUEUE, ROUTER_ROUTE
from tests.common.local_bus_helpers import bus  # noqa: F401  (the fixture)

# --- the services' own NATS code on the bus ----------------------------------------------------


async def test_the_frontend_inbox_relay_and_the_router_publisher_work_on_the_bus(bus):
    from infera_frontend.failover import NO_ROUTER, RetryableError
    from infera_frontend.inbox import Inbox
    from infera_frontend.metrics import FrontendMetrics
    from infera_frontend.relay import Relay
    from infera_frontend.validation import ApiError
    from infera_router.jetstream import AckedPublisher

    fe = bus.connect("frontend")
    inbox = Inbox(fe, "fe-1")
    await inbox.start()
    relay = Relay(fe, inbox, FrontendMetrics(), route_timeout=1, upstream_timeout=5, request_timeout=60)

    async def open_request(body: bytes = b"{}"):
        return await relay.open(request_id="r1", endpoint=Endpoint.CHAT, model="m", body=body, stream=False,
                                token_ids=None, prompt_tokens=1)

    with pytest.raises(RetryableError) as no_router:  # nobody on infera.router.route: NATS "no responders"
        await open_request()
    assert no_router.value.reason == NO_ROUTER and no_router.value.status == 503
    with pytest.raises(ApiError) as too_large:  # the frontend reads the bus's max_payload
        await open_request(b"x" * (DEFAULT_MAX_PAYLOAD + 1))
    assert too_large.value.status == 413

    router = bus.connect("router")

    async def route(msg: Msg) -> None:  # a router that refuses: its reply reaches the request's inbox
        await router.publish(msg.reply, encode(RouteReply(status=404, message="no such model")))

    await router.subscribe(ROUTER_ROUTE, queue=ROUTER_QUEUE, cb=route)
    with pytest.raises(ApiError) as refused:
        await open_request()
    assert refused.value.status == 404 and len(inbox) == 0  # every attempt's mailbox released

    publisher = AckedPublisher(router)  # the router's JetStream publish: with no stream, "no responders"
    await publisher.start()
    results = asyncio.Queue()
    await publisher.publish("infera.work.w1", b"envelope", 5, results.put)
    assert (await results.get()).kind == "gone"

    async def fake_stream(msg: Msg) -> None:
        await msg.respond(b'{"stream": "INFERA_REQ_w1", "seq": 1}')

    await bus.connect("stream").subscribe("infera.work.w1", cb=fake_stream)
    await publisher.publish("infera.work.w1", b"envelope", 5, results.put)
    assert (await results.get()).kind == "stored"
    await publisher.stop()
    await inbox.stop()
    await close_connection(fe)
    await close_connection(router)


async def test_the_router_asks_the_kv_indexer_over_the_bus():
    from infera_kv_indexer.service import KvIndexerService
    from infera_kv_indexer.settings import KvIndexerSettings
    from infera_router.kv_client import KvClient
    from infera_router.metrics import RouterMetrics
    from infera_router.state import WorkerState
    from tests.kv_indexer.kv_fakes import MODEL, FakeEngine, query, record, tokens
    from tests.kv_indexer.test_kv_index import feed

    bus = LocalBus()
    router_nc, indexer_nc = bus.connect("router"), bus.connect("kv-indexer")
    metrics = RouterMetrics()
    kv = KvClient(router_nc, timeout=5, metrics=metrics)
    candidates = [WorkerState(record("w1")), WorkerState(record("w2"))]
    prompt = tokens(16)

    view = await kv.query(query(prompt), candidates)
    assert not view.ok and view.failure == "no_indexer"

    indexer = KvIndexerService(KvIndexerSettings())
    indexer.index.worker_joined("w1", MODEL)
    engine = FakeEngine("w1")
    feed(indexer.index, engine, engine.stored(prompt[:8]))  # w1 caches the first 2 blocks of 4
    sub = await indexer_nc.subscribe(KV_QUERY, queue=KV_INDEXER_QUEUE, cb=indexer._on_query)

    view = await kv.query(query(prompt), candidates)
    assert view.ok and view.depth == {"w1": 2}
    raw = await router_nc.request(KV_QUERY, encode(query(prompt)), timeout=5)
    assert [o.worker_id for o in decode(OverlapReply, raw.data).overlaps] == ["w1"]
    assert msgpack.unpackb(raw.data, raw=False)  # the indexer's own bytes, untouched

    await unsubscribe_quietly(sub)
    await bus.close()
    view = await kv.query(query(prompt), candidates)  # a closed connection: counted, never raised
    assert not view.ok and view.failure == "error"
