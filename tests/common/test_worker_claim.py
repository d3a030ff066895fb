"""One worker id, one live agent: the claim a registrar makes before its first put, decided by
``worker_claim.verdict`` (pure) and shown against a real nats-server and a real etcd."""

from __future__ import annotations

import asyncio
import time

import pytest

from infera_common.discovery import Registrar
from infera_common.discovery_etcd import EtcdRegistrar
from infera_common.etcd_gateway import EtcdClient
from infera_common.nats_conn import connect
from infera_common.schemas import WorkerRecord, WorkerStatus, decode
from infera_common.subjects import DISCOVERY_BUCKET
from infera_common.worker_claim import MARGIN, WorkerIdTaken, verdict


def record(wid: str = "w", ttl: float = 2.0, url: str = "http://10.0.0.1:30000", **kw) -> WorkerRecord:
    return WorkerRecord(worker_id=wid, model="m", engine="mock", url=url, advertise_host="10.0.0.1", ttl=ttl,
                        status=WorkerStatus.ACTIVE, **kw)


def test_the_verdict_tells_a_live_holder_from_an_entry_left_behind():
    seen = record(heartbeat_at=100.0)
    beat = seen.model_copy(update={"heartbeat_at": 100.7})
    for put in (True, False):
        assert verdict(None, None, 0.0, refreshed_by_put=put) == "free"  # nobody
        assert verdict(seen, None, 0.5, refreshed_by_put=put) == "free"  # deregistered, or aged out
        assert verdict(seen, seen, 0.5, refreshed_by_put=put) == "wait"
        assert verdict(seen, beat, 0.5, refreshed_by_put=put) == "taken"  # written while watched
        assert verdict(None, seen, 0.5, refreshed_by_put=put) == "taken"  # appeared while watched
    # a whole ttl without a write: left behind where the record is kept by puts (NATS), held by
    # its lease where a key lives on keep-alives (etcd)
    assert verdict(seen, seen, seen.ttl + MARGIN, refreshed_by_put=True) == "free"
    assert verdict(seen, seen, seen.ttl + MARGIN, refreshed_by_put=False) == "taken"


async def test_nats_a_second_agent_with_a_live_agents_id_is_refused(nats_server):
    nc = await connect(nats_server, "t")
    js = nc.jetstream()
    first = Registrar(js, record(ttl=1.5, url="http://10.0.0.1:1"))
    await first.start()
    t0 = time.monotonic()
    with pytest.raises(WorkerIdTaken, match="'w' is held by another live worker-agent \\(its engine at "
                                            "http://10.0.0.1:1"):
        await Registrar(js, record(ttl=1.5, url="http://10.0.0.2:1")).start()
    assert time.monotonic() - t0 < 1.5  # the holder's next heartbeat (ttl/3) told
    await first.stop()
    # deregistered: the id is free at once
    second = Registrar(js, record(ttl=1.5, url="http://10.0.0.2:1"))
    t0 = time.monotonic()
    await second.start()
    assert time.monotonic() - t0 < 1.5  # no wait for a ttl: there was no entry to watch
    await second.stop()
    await nc.close()


async def test_nats_an_entry_left_by_a_killed_agent_is_taken_over_after_its_ttl(nats_server):
    nc = await connect(nats_server, "t")
    js = nc.jetstream()
    killed = Registrar(js, record(ttl=1.5))
    await killed.start()
    killed._task.cancel()  # as SIGKILL: no more heartbeats, no deregistration
    t0 = time.monotonic()
    restarted = Registrar(js, record(ttl=1.5, url="http://10.0.0.1:30001"))
    await restarted.start()
    assert 1.5 <= time.monotonic() - t0 < 1.5 + MARGIN + 1.5
    entry = await (await js.key_value(DISCOVERY_BUCKET)).get("w")
    assert decode(WorkerRecord, entry.value).url == "http://10.0.0.1:30001"
    await restarted.stop()
    await nc.close()


async def test_nats_two_agents_started_together_with_one_id_one_wins(nats_server):
    nc = await connect(nats_server, "t")
    js = nc.jetstream()
    regs = [Registrar(js, record(ttl=1.5, url=f"http://10.0.0.{i}:1")) for i in (1, 2)]
    results = await asyncio.gather(*(r.start() for r in regs), return_exceptions=True)
    assert sorted(type(r).__name__ for r in results) == ["NoneType", "WorkerIdTaken"]
    for reg, result in zip(regs, results):
        if result is None:
            await reg.stop()
    await nc.close()


async def test_etcd_a_second_agent_with_a_live_agents_id_is_refused_and_a_killed_ones_key_is_taken_over(
        etcd_server):
    first = EtcdRegistrar(etcd_server.endpoint, record(url="http://10.0.0.1:1"))
    await first.start()
    t0 = time.monotonic()
    with pytest.raises(WorkerIdTaken, match="its engine at http://10.0.0.1:1"):
        await EtcdRegistrar(etcd_server.endpoint, record(url="http://10.0.0.2:1")).start()
    assert time.monotonic() - t0 >= 2.0  # a lease is watched for its whole ttl
    # killed: keep-alives stop, the lease (2 s) drops the key, the restarted agent takes the id
    first._task.cancel()
    restarted = EtcdRegistrar(etcd_server.endpoint, record(url="http://10.0.0.1:2"))
    await restarted.start()
    held = await restarted._client.get(restarted.key)
    assert WorkerRecord.model_validate_json(held.value).url == "http://10.0.0.1:2"
    await restarted.stop()
    await first._close()


async def test_etcd_create_writes_only_where_no_key_is(etcd_server):
    client = EtcdClient(etcd_server.endpoint)
    try:
        assert await client.create("/infera/test/claim", b"first")
        assert not await client.create("/infera/test/claim", b"second")
        assert (await client.get("/infera/test/claim")).value == b"first"
        assert await client.get("/infera/test/claim-not-there") is None
    finally:
        await client.close()
