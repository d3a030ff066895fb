"""The kv-aware router against a real nats-server, with a fake kv-indexer answering on KV_QUERY."""

from __future__ import annotations

import pytest

from infera_common.block_hash import block_hashes
from infera_common.discovery import Registrar
from infera_common.nats_conn import connect, ensure_request_stream
from infera_common.schemas import OverlapQuery, OverlapReply, RouteReply, WorkerOverlap, decode, encode
from infera_common.subjects import KV_INDEXER_QUEUE, KV_QUERY, ROUTER_ROUTE

from infera_router.service import RouterService
from infera_router.settings import RouterSettings

from router_helpers import record, route_request
from test_router_service import eventually

TOKENS = list(range(500, 500 + 64 * 6))  # 6 blocks of 64


@pytest.fixture
async def kv_bench(nats_server):
    router = RouterService(RouterSettings(nats_url=nats_server, router_id="kv1", router_policy="kv-aware",
                                          kv_query_timeout=0.5))
    await router.start()
    nc = await connect(nats_server, "kv-test")
    js = nc.jetstream()
    regs = []
    for wid, bs in (("a", 64), ("b", 64), ("c", 32)):
        await ensure_request_stream(js, wid, 20, max_age=60)
        reg = Registrar(js, record(wid, kv_block_size=bs, max_pending=20))
        await reg.start()
        regs.append(reg)
    await eventually(lambda: len(router.core.fleet.active("m")) == 3)
    yield router, nc
    for reg in regs:
        await reg.stop()
    await router.stop()
    await nc.close()


async def route(nc, rid: str) -> RouteReply:
    req = route_request(request_id=rid, token_ids=TOKENS, prompt_tokens=len(TOKENS))
    return decode(RouteReply, (await nc.request(ROUTER_ROUTE, encode(req), timeout=5)).data)


def metric(router, name: str, **labels) -> float:
    return router.metrics.registry.get_sample_value(name, labels) or 0.0


async def test_request_goes_to_the_deepest_overlap(kv_bench):
    router, nc = kv_bench
    queries: list[OverlapQuery] = []

    async def indexer(msg):
        q = decode(OverlapQuery, msg.data)
        queries.append(q)
        # the indexer would match the request's own hashes: c (block size 32) holds 10 of 12 blocks
        assert q.hashes[32] == block_hashes(TOKENS, 32) and q.hashes[64] == block_hashes(TOKENS, 64)
        reply = OverlapReply(overlaps=[WorkerOverlap(worker_id="a", dp_rank=0, blocks=1),
                                       WorkerOverlap(worker_id="c", dp_rank=0, blocks=10)], unseen=["b"])
        await msg.respond(encode(reply))

    sub = await nc.subscribe(KV_QUERY, queue=KV_INDEXER_QUEUE, cb=indexer)
    try:
        replies = [await route(nc, f"r{i}") for i in range(2)]
    finally:
        await sub.unsubscribe()
    assert [r.status for r in replies] == [200, 200]
    # r0 -> c (2 uncached blocks of 32). r1 -> c again: r0's whole prompt is in flight there, so
    # all 12 blocks count as (about to be) cached although the indexer still says 10, of which the
    # engine reuses 11 (the prompt's last token is computed); c's prefill load is r0's 2 blocks (its
    # cached 10 are no prefill work) and r1's last one
    assert [r.worker_id for r in replies] == ["c", "c"]
    assert len(queries) == 2 and queries[0].model == "m" and sorted(queries[0].workers) == ["a", "b", "c"]
    assert metric(router, "infera_router_kv_picks_total", worker="c") == 2
    assert metric(router, "infera_router_kv_hit_blocks_sum") == 10 + 11
    c = router.core.fleet.get("c")
    assert (c.in_flight, c.prefill_tokens) == (2, 2 * 32 + 32)
    assert metric(router, "infera_router_kv_request_blocks_count") == 2
    assert metric(router, "infera_router_kv_workers_without_events", worker="b", reason="unseen") == 1
    assert metric(router, "infera_router_kv_query_failures_total", reason="no_indexer") == 0


async def test_without_an_indexer_requests_are_routed_by_load_and_counted(kv_bench):
    router, nc = kv_bench
    replies = [await route(nc, f"n{i}") for i in range(3)]
    assert [r.status for r in replies] == [200] * 3
    assert sorted(r.worker_id for r in replies) == ["a", "b", "c"]  # load only spreads them
    failures = (metric(router, "infera_router_kv_query_failures_total", reason="no_indexer")
                + metric(router, "infera_router_kv_query_failures_total", reason="timeout"))
    assert failures == 3
    assert metric(router, "infera_router_kv_picks_without_cache_info_total", reason="no_indexer") + metric(
        router, "infera_router_kv_picks_without_cache_info_total", reason="timeout") == 3
    assert metric(router, "infera_router_kv_query_seconds_count") == 3


async def test_debug_log_tells_the_pick_and_its_cost_breakdown(nats_server, monkeypatch):
    from infera_router import routing as service_module  # the route path logs the pick

    lines: list[tuple[str, dict]] = []

    class Recorder:
        def debug(self, event, **kw):
            lines.append((event, kw))

        def __getattr__(self, name):
            return lambda *a, **k: None

    monkeypatch.setattr(service_module, "log", Recorder())
    router = RouterService(RouterSettings(nats_url=nats_server, router_id="kv2", log_level="debug"))
    await router.start()
    nc = await connect(nats_server, "kv-debug")
    reg = None
    try:
        await ensure_request_stream(nc.jetstream(), "a", 5, max_age=60)
        reg = Registrar(nc.jetstream(), record("a", kv_block_size=64, max_pending=5))
        await reg.start()
        await eventually(lambda: len(router.core.fleet.active("m")) == 1)
        assert (await route(nc, "d0")).worker_id == "a"
    finally:
        if reg is not None:
            await reg.stop()
        await router.stop()
        await nc.close()
    [(_, pick)] = [line for line in lines if line[0] == "route_pick"]
    assert pick["worker_id"] == "a" and pick["request_id"] == "d0"
    [cost] = pick["costs"]
    assert (cost["worker"], cost["request_blocks"], cost["block_size"]) == ("a", 6, 64)
    assert cost["cache_info"] in ("no_indexer", "timeout")


async def test_a_prompt_shorter_than_every_block_is_routed_without_asking_the_indexer(kv_bench):
    """No full block at 32 or 64 tokens: no worker can hold any of it, so the indexer round trip is
    skipped (counted), the pick is by load alone, and an unseen worker's gauge is left as it was."""
    router, nc = kv_bench
    queries: list[OverlapQuery] = []

    async def indexer(msg):
        queries.append(decode(OverlapQuery, msg.data))
        await msg.respond(encode(OverlapReply(overlaps=[], unseen=["b"])))

    sub = await nc.subscribe(KV_QUERY, queue=KV_INDEXER_QUEUE, cb=indexer)
    try:
        long = await route(nc, "long")  # 6 blocks: asked; b is unseen
        short = TOKENS[:31]
        replies = [decode(RouteReply, (await nc.request(ROUTER_ROUTE, encode(route_request(
            request_id=f"s{i}", token_ids=short, prompt_tokens=len(short))), timeout=5)).data) for i in range(3)]
    finally:
        await sub.unsubscribe()
    assert [r.status for r in replies] == [200] * 3
    assert len(queries) == 1  # only the long prompt's
    assert metric(router, "infera_router_kv_queries_skipped_total") == 3
    assert metric(router, "infera_router_kv_query_failures_total", reason="no_indexer") == 0
    assert metric(router, "infera_router_kv_picks_without_cache_info_total", reason="no_indexer") == 0
    assert metric(router, "infera_router_kv_workers_without_events", worker="b", reason="unseen") == 1
    # by load: the long prompt's worker has its whole prompt still to prefill, so the first short one goes elsewhere
    assert replies[0].worker_id != long.worker_id


async def test_a_failure_while_deciding_answers_500_and_still_ends_the_route_span(kv_bench, monkeypatch):
    from infera_router import routing

    started, ended = [], []
    real_start, real_finish = routing.start_span, routing.finish

    def start(name, *args, **kw):
        started.append(name)
        return real_start(name, *args, **kw)

    def end(span, *args, **kw):
        ended.append(span)
        return real_finish(span, *args, **kw)

    def broken(request):
        raise RuntimeError("index view broken")

    router, nc = kv_bench
    monkeypatch.setattr(routing, "start_span", start)
    monkeypatch.setattr(routing, "finish", end)
    monkeypatch.setattr(router.core, "kv_query", broken)
    reply = await route(nc, "x")
    assert reply.status == 500 and "index view broken" in reply.message
    assert started == ["route"] and len(ended) == 1
    monkeypatch.undo()
    assert (await route(nc, "y")).status == 200  # the router goes on serving
