"""The router's kv-indexer query when no indexer is subscribed (right after a broker restart an
indexer that answered a moment ago is waited for, briefly, instead of routing blind) and when one
of the indexers is silent."""

from __future__ import annotations

from nats.errors import NoRespondersError

from infera_common.answering import ping_answerer
from infera_common.nats_conn import connect, flush_all
from infera_common.schemas import OverlapQuery, OverlapReply, encode
from infera_common.subjects import KV_INDEXER_QUEUE, KV_PING, KV_QUERY, kv_query_subject
from infera_router.kv_client import KvClient
from infera_router.metrics import RouterMetrics


class Msg:
    def __init__(self, data: bytes) -> None:
        self.data = data


class Bus:
    """Answers with an empty overlap reply, except while ``away`` says no indexer is subscribed."""

    def __init__(self) -> None:
        self.away = 0  # questions still to get "no responders"
        self.asked = 0

    async def request(self, subject, data, timeout, headers=None):
        self.asked += 1
        if self.away:
            self.away -= 1
            raise NoRespondersError
        return Msg(encode(OverlapReply(workers=[])))


def query() -> OverlapQuery:
    return OverlapQuery(model="m", hashes={64: [1, 2]}, workers=["w1"])


async def test_an_indexer_that_answered_lately_is_waited_for_while_it_reconnects():
    bus = Bus()
    client = KvClient(bus, 0.05, RouterMetrics())
    assert (await client.query(query(), [])).ok
    bus.away = 3  # the broker restarted; the indexer is back three questions later
    assert (await client.query(query(), [])).ok and bus.asked == 5


async def test_a_fleet_whose_indexer_never_answered_is_not_waited_for():
    bus = Bus()
    bus.away = 100
    client = KvClient(bus, 0.05, RouterMetrics())
    view = await client.query(query(), [])
    assert not view.ok and view.failure == "no_indexer" and bus.asked == 1


async def test_after_a_query_times_out_queries_go_to_an_indexer_that_answers(nats_server):
    """A frozen kv-indexer (SIGSTOP, a hung host) stays in the queue group until the broker drops it,
    20-30 s: every query it takes times out and its request is routed on load alone, its cached
    prefix missed (bench/ha.py indexer-freeze). After one has, the queries go to the indexer that
    answers the ping."""
    router, frozen, live = [await connect(nats_server, n) for n in ("router", "frozen", "live")]
    try:
        async def silent(msg) -> None:  # frozen: takes the queue group's share and the ping, answers nothing
            pass

        async def answer(msg) -> None:
            await msg.respond(encode(OverlapReply(workers=[])))

        await frozen.subscribe(KV_QUERY, queue=KV_INDEXER_QUEUE, cb=silent)
        await frozen.subscribe(KV_PING, cb=silent)
        await live.subscribe(KV_PING, cb=ping_answerer("kvi-live"))
        await live.subscribe(kv_query_subject("kvi-live"), cb=answer)
        for nc in (frozen, live):
            await flush_all(nc)
        metrics = RouterMetrics()
        client = KvClient(router, 0.2, metrics)
        first = await client.query(query(), [])
        assert not first.ok and first.failure == "timeout"
        assert all([(await client.query(query(), [])).ok for _ in range(3)])  # the live one, on its own subject
        assert metrics.registry.get_sample_value("infera_router_kv_queries_direct_total") == 3
    finally:
        for nc in (router, frozen, live):
            await nc.close()
