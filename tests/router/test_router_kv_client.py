"""The router's kv-indexer query when no indexer is subscribed: right after a broker restart an
indexer that answered a moment ago is waited for (briefly) instead of routing blind."""

from __future__ import annotations

from nats.errors import NoRespondersError

from infera_common.schemas import OverlapQuery, OverlapReply, encode
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
