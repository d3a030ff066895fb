"""The kv-indexer on ``--kv-event-transport zmq`` inside another process: handed a client of the
in-process bus (``infera_common.local_bus``, which has no JetStream: any use of it raises), discovery
in a real etcd, engine publishers driven by hand on real ZMQ sockets.

Shows a gap filled from the replay socket, a gap replay cannot fill, an engine restarted behind
the same endpoint (its seq going back), DP ranks, and a worker leaving discovery being dropped.
"""

from __future__ import annotations

import asyncio

import msgpack
import pytest
from aiohttp import web

from infera_common.discovery_select import Discovery
from infera_common.kv_translate import SLICE_BLOCKS, BlockTranslator, dump_translator
from infera_common.kv_wire import decode_batch
from infera_common.local_bus import LocalBus
from infera_kv_indexer.service import KvIndexerService
from infera_kv_indexer.settings import KvIndexerSettings
from tests.kv_indexer.kv_fakes import FakeEngine, depths, query, tokens
from tests.kv_indexer.zmq_helpers import (
    FakePublisher, ask_bus, empty_batch, eventually, probe_until, sample,
)


@pytest.fixture
async def local_indexer(etcd_server):
    """The indexer on an in-process bus client (no JetStream), with etcd discovery; yields (service, a client of
    the same bus, registrar factory)."""
    bus = LocalBus(name="kv-test")
    settings = KvIndexerSettings(discovery_backend="etcd", etcd_endpoint=etcd_server.endpoint,
                                 kv_event_transport="zmq", kv_replay_timeout=2.0)
    discovery = Discovery("etcd", etcd_server.endpoint)
    registrars = []

    async def register(record):
        reg = discovery.registrar(record)
        await reg.start()
        registrars.append(reg)
        return reg

    handed = bus.connect("kv-indexer")
    service = KvIndexerService(settings, nc=handed)
    yield service, bus.connect("router"), register
    for reg in registrars:
        await reg.stop()
    await service.stop()
    assert not handed.is_closed  # a client handed in is the caller's to close
    await bus.close()


def overlap(service, prompt):
    return depths(service.index.overlap(query(prompt)))


async def test_gaps_restarts_and_leaving_on_hand_driven_publishers(local_indexer):
    service, bus, register = local_indexer
    pub = FakePublisher()
    engine = FakeEngine("w1", "vllm")
    prompt = tokens(16)
    reg = await register(pub.record("w1"))
    await service.start()
    assert service._zmq.followed.keys() == {"w1"}
    assert pub.replay_requests == [0]  # the first replay, from seq 0 (nothing published yet)

    await pub.send(0, engine.batch([engine.stored(prompt[:8])]))
    await probe_until(pub, 0, lambda: overlap(service, prompt) == {("w1", 0): 2})
    assert depths(await ask_bus(bus, query(prompt))) == {("w1", 0): 2}  # answered over the bus too
    await eventually(lambda: sample(service, "infera_kv_indexer_zmq_endpoints_connected", {"worker": "w1"}) == 1)

    # seq 1 never reaches the SUB socket: seq 2 reveals the gap, replay fills it (2's parent is in 1)
    await pub.send(1, engine.batch([engine.stored(prompt[:12])]), skip=True)
    await pub.send(2, engine.batch([engine.stored(prompt)]))
    await probe_until(pub, 2, lambda: overlap(service, prompt) == {("w1", 0): 4})
    assert pub.replay_requests == [0, 1]
    assert sample(service, "infera_kv_indexer_zmq_gaps_total", {"outcome": "filled"}) == 1
    assert sample(service, "infera_kv_indexer_zmq_replayed_batches_total") == 1

    # seq 3 is gone from replay too: counted lost, seq 4 still applied
    lost, kept = tokens(4, start=7000), tokens(4, start=8000)
    await pub.send(3, engine.batch([engine.stored(lost)]), skip=True)
    del pub.history[3]
    await pub.send(4, engine.batch([engine.stored(kept)]))
    await probe_until(pub, 4, lambda: overlap(service, kept) == {("w1", 0): 1})
    assert overlap(service, lost) == {}
    assert sample(service, "infera_kv_indexer_zmq_gaps_total", {"outcome": "unrecoverable"}) == 1
    assert sample(service, "infera_kv_indexer_zmq_lost_batches_total") == 1

    # the engine restarts behind the same ports: its seq starts over, its cache is empty
    await pub.close()
    pub = FakePublisher(pub.port, pub.replay_port)
    fresh = FakeEngine("w1", "vllm", seed=1)
    other = tokens(8, start=9000)
    await pub.send(0, fresh.batch([fresh.stored(other)], ts=2.0))
    await probe_until(pub, 0, lambda: overlap(service, other) == {("w1", 0): 2})
    assert overlap(service, prompt) == {} and overlap(service, kept) == {}
    assert sample(service, "infera_kv_indexer_zmq_engine_restarts_total", {"how": "seq"}) == 1

    # a malformed message is counted and the reader keeps going
    await pub.pub.send_multipart([b"", b"short"])
    await pub.send(1, empty_batch(3.0))
    await probe_until(pub, 1, lambda: sample(service, "infera_kv_indexer_malformed_total", {"kind": "zmq"}) == 1)

    # leaving discovery: the worker, its blocks and its subscription go
    await reg.stop()
    await eventually(lambda: not service._zmq.followed)
    assert overlap(service, other) == {}
    assert sample(service, "infera_kv_indexer_zmq_workers") == 0
    assert service.metrics.registry.get_sample_value(
        "infera_kv_indexer_zmq_endpoints_connected", {"worker": "w1"}) is None
    await pub.send(2, fresh.batch([fresh.stored(tokens(8, start=100))], ts=4.0))
    await pub.resend(2)
    assert overlap(service, tokens(8, start=100)) == {}
    await pub.close()


async def test_each_dp_rank_publisher_is_read_as_its_rank(local_indexer):
    service, _bus, register = local_indexer
    pubs = [FakePublisher(), FakePublisher()]
    engines = [FakeEngine("dp", "sglang"), FakeEngine("dp", "sglang", seed=1)]  # batches without a rank
    record = pubs[0].record("dp").model_copy(update={
        "dp_size": 2,
        "kv_events_endpoints": [f"tcp://127.0.0.1:{p.port}" for p in pubs],
        "kv_replay_endpoints": [f"tcp://127.0.0.1:{p.replay_port}" for p in pubs],
    })
    prompt = tokens(16)
    try:
        # rank 1 published before the indexer started: the first replay brings it
        await pubs[1].send(0, engines[1].batch([engines[1].stored(prompt)]))
        await register(record)
        await service.start()
        assert overlap(service, prompt) == {("dp", 1): 4}
        await pubs[0].send(0, engines[0].batch([engines[0].stored(prompt[:8])]))
        await probe_until(pubs[0], 0, lambda: overlap(service, prompt) == {("dp", 0): 2, ("dp", 1): 4})
    finally:
        for pub in pubs:
            await pub.close()


async def test_a_long_prompts_blocks_are_indexed_in_slices_letting_the_servers_requests_run_between(local_indexer):
    """In ``infera.server`` the index shares its process with the frontend and router: a 32k-token
    prompt's 512 per-block events applied at once would hold every request in the process meanwhile."""
    service, _bus, register = local_indexer
    pub = FakePublisher()
    turns = {"n": 0}
    spans: list[int] = []
    index = service.index
    open_batch, close_batch = index.open_batch, index.close_batch
    began: list[int] = []

    def opening(*args):
        began.append(turns["n"])
        return open_batch(*args)

    def closing(raw, unreadable=0):
        spans.append(turns["n"] - began[-1])
        return close_batch(raw, unreadable)

    index.open_batch, index.close_batch = opening, closing

    async def other_work() -> None:
        while True:
            turns["n"] += 1
            await asyncio.sleep(0)

    engine = FakeEngine("w1", "sglang", block_size=4)
    prompt = tokens(4 * 512)
    events = [engine.stored(prompt[:4 * (i + 1)]) for i in range(512)]  # one event per block, chained
    await register(pub.record("w1"))
    await service.start()
    ticker = asyncio.create_task(other_work())
    try:
        await pub.send(0, engine.batch(events[:1]))
        await probe_until(pub, 0, lambda: overlap(service, prompt) == {("w1", 0): 1})
        await pub.send(1, engine.batch(events[1:]))
        await probe_until(pub, 1, lambda: overlap(service, prompt) == {("w1", 0): 512})
        assert spans[0] == 0 and spans[-1] >= 511 // SLICE_BLOCKS
    finally:
        ticker.cancel()
        await pub.close()


async def test_a_batch_being_applied_when_its_reader_is_replaced_is_applied_whole(local_indexer):
    """A record that moves the worker's endpoints replaces its reader; the batch the old reader was
    applying slice by slice is finished at once, not left half applied (its seq already counts as done,
    so the new reader's replay skips it)."""
    service, _bus, register = local_indexer
    pub = FakePublisher()
    engine = FakeEngine("w1", "sglang", block_size=4)
    prompt = tokens(4 * 256)
    events = [engine.stored(prompt[:4 * (i + 1)]) for i in range(256)]
    record = pub.record("w1")
    moved = record.model_copy(update={"kv_events_endpoints": [f"tcp://localhost:{pub.port}"]})
    index = service.index
    open_batch = index.open_batch

    def opening(worker_id, dp_rank, seq, now):
        if seq == 1:
            service._zmq.on_record(moved)  # the old reader is closed while this batch is half applied
        return open_batch(worker_id, dp_rank, seq, now)

    index.open_batch = opening
    await register(record)
    await service.start()
    try:
        await pub.send(0, engine.batch(events[:1]))
        await probe_until(pub, 0, lambda: overlap(service, prompt) == {("w1", 0): 1})
        await pub.send(1, engine.batch(events[1:]))
        await eventually(lambda: service._zmq.followed["w1"].feed.sources[0].endpoint.startswith("tcp://localhost"))
        await eventually(lambda: overlap(service, prompt) == {("w1", 0): 256}, timeout=5)
    finally:
        await pub.close()


async def test_an_index_that_starts_late_reads_the_agents_state_before_the_engines_short_replay(local_indexer):
    """A restarted infera.server: the engine's replay buffer holds only its last batches. The prompt
    stored before them is still cached; without the agent's state it stayed unknown, its extension
    was orphaned (parent unknown), and its eviction could not be applied. With it, all three are."""
    service, _, register = local_indexer
    engine = FakeEngine("w1", "vllm")
    agent = BlockTranslator(None)  # the worker-agent followed every batch from the engine's start
    old, extended = tokens(8), tokens(16)
    batches = [engine.batch([engine.stored(old)])] + [empty_batch(float(i)) for i in range(1, 6)]
    for payload in batches:
        agent.apply(decode_batch(payload).events)
    pub = FakePublisher()
    for seq in (4, 5):  # what is left in the engine's replay buffer
        pub.history[seq] = batches[seq]
    state = msgpack.packb([{"dp_rank": 0, "seq": 5, "translator": dump_translator(agent)}], use_bin_type=True)

    async def kv_state(_request):
        return web.Response(body=state)

    app = web.Application()
    app.router.add_get("/kv_state", kv_state)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/kv_state"
    try:
        await register(pub.record("w1").model_copy(update={"kv_state_url": url}))
        await service.start()
        assert overlap(service, old) == {("w1", 0): 2}
        assert pub.replay_requests == [0] and sample(service, "infera_kv_indexer_zmq_agent_states_total",
                                                     {"result": "read"}) == 1
        await pub.send(6, engine.batch([engine.stored(extended)]))  # chained on the old prompt's last block
        await probe_until(pub, 6, lambda: overlap(service, extended) == {("w1", 0): 4})
        await pub.send(7, engine.batch([engine.removed(extended, 1)]))  # evicted down to its first block
        await probe_until(pub, 7, lambda: overlap(service, extended) == {("w1", 0): 1})
    finally:
        await pub.close()
        await runner.cleanup()
