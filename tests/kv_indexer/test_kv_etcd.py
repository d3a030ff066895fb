"""The kv-indexer on ``--discovery-backend etcd``: workers registered in etcd get their answers, and
leave them when their etcd entry goes."""

from __future__ import annotations

from infera_common.discovery_select import Discovery
from infera_common.nats_conn import connect
from infera_kv_indexer.service import KvIndexerService
from infera_kv_indexer.settings import KvIndexerSettings
from tests.kv_indexer.kv_fakes import FakeEngine, depths, query, record, tokens
from tests.kv_indexer.test_kv_service import until


async def test_indexer_follows_workers_registered_in_etcd(nats_server, etcd_server):
    nc = await connect(nats_server, "kv-test")
    service = KvIndexerService(KvIndexerSettings(nats_url=nats_server, discovery_backend="etcd",
                                                 etcd_endpoint=etcd_server.endpoint))
    await service.start()
    discovery = Discovery("etcd", etcd_server.endpoint)
    regs = [discovery.registrar(record(w)) for w in ("w1", "w2")]
    try:
        for reg in regs:
            await reg.start()
        prompt = tokens(16)
        for wid in ("w1", "w2"):
            engine = FakeEngine(wid)
            await nc.jetstream().publish(engine.subject, engine.relay(engine.stored(prompt)))
        await until(nc, query(prompt), lambda r: depths(r) == {("w1", 0): 4, ("w2", 0): 4})
        await regs.pop(0).stop()  # revokes its lease: the key goes at once
        reply = await until(nc, query(prompt), lambda r: depths(r) == {("w2", 0): 4})
        assert reply.unseen == []
    finally:
        for reg in regs:
            await reg.stop()
        await service.stop()
        await nc.close()
