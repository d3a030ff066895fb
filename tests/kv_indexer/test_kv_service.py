"""The kv-indexer service in-process against a real nats-server: relayed engine batches in,
overlap answers out over NATS request/reply."""

from __future__ import annotations

import asyncio

import pytest

from infera_common.discovery import Registrar
from infera_common.nats_conn import KV_EVENT_MAX_AGE, KV_EVENT_MAX_BYTES, connect, ensure_kv_event_stream
from infera_common.block_hash import block_hashes, pack_hashes
from infera_common.schemas import KvRelay, KvResync, OverlapReply, decode, encode
from infera_common.subjects import (
    KV_EVENT_STREAM, KV_PING, KV_QUERY, KV_RESYNC, kv_event_subject, kv_query_subject,
)
from infera_kv_indexer.service import KvIndexerService
from infera_kv_indexer.settings import KvIndexerSettings
from nats.js.api import RetentionPolicy, StorageType
from tests.kv_indexer.kv_fakes import FakeEngine, cleared_relay, depths, query, record, tokens


async def ask(nc, q) -> OverlapReply:
    return decode(OverlapReply, (await nc.request(KV_QUERY, encode(q), timeout=5)).data)


async def until(nc, q, check, timeout: float = 10.0) -> OverlapReply:
    """Query until ``check(reply)`` holds (events are applied asynchronously)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        reply = await ask(nc, q)
        if check(reply):
            return reply
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"last reply: {reply}")
        await asyncio.sleep(0.05)


@pytest.fixture
async def bus(nats_server):
    """A client connection, the indexer in-process, and a helper registering workers."""
    nc = await connect(nats_server, "kv-test")
    service = KvIndexerService(KvIndexerSettings(nats_url=nats_server, kv_event_max_age=120))
    await service.start()
    registrars: dict[str, Registrar] = {}

    async def register(worker_id: str, **kw) -> Registrar:
        registrars[worker_id] = reg = Registrar(nc.jetstream(), record(worker_id, **kw))
        await reg.start()
        return reg

    yield nc, service, register, registrars
    for reg in registrars.values():
        await reg.stop()
    await service.stop()
    await nc.close()


async def publish(nc, engine: FakeEngine, data: bytes) -> None:
    await nc.jetstream().publish(engine.subject, data)


async def test_relayed_batches_of_both_engines_answer_prefix_depths_per_worker(bus):
    nc, _service, register, _ = bus
    for w in ("vl", "sg", "idle"):
        await register(w)
    vl, sg = FakeEngine("vl", "vllm"), FakeEngine("sg", "sglang")
    system = tokens(32)
    chat = system + tokens(12, start=5000)
    await publish(nc, vl, vl.relay(vl.stored(system)))
    await publish(nc, vl, vl.relay(vl.stored(chat)))  # parent = the engine hash of block 7
    await publish(nc, sg, sg.relay(sg.stored(system[:20])))
    reply = await until(nc, query(chat), lambda r: len(r.overlaps) == 2)
    assert depths(reply) == {("vl", 0): 11, ("sg", 0): 5}
    assert reply.unseen == ["idle"]
    only = await ask(nc, query(chat, workers=["sg", "idle"]))
    assert depths(only) == {("sg", 0): 5} and only.unseen == ["idle"]
    # eviction on the vLLM worker cuts its prefix; the SGLang worker's engine restarts empty
    await publish(nc, vl, vl.relay(vl.removed(chat, 9)))
    await nc.jetstream().publish(kv_event_subject("sg"), cleared_relay("sg"))
    reply = await until(nc, query(chat), lambda r: depths(r) == {("vl", 0): 9})
    assert reply.unseen == ["idle"]


async def test_the_indexer_says_it_is_there_and_answers_queries_sent_to_it_alone(bus):
    """What a router whose query to the queue group went unanswered (an indexer frozen) uses to
    send the next ones to an indexer that answers."""
    nc, service, register, _ = bus
    await register("w1")
    pong = await nc.request(KV_PING, b"", timeout=5)
    assert pong.data.decode() == service.indexer_id
    msg = await nc.request(kv_query_subject(service.indexer_id), encode(query(tokens(64))), timeout=5)
    assert decode(OverlapReply, msg.data).unseen == ["w1"]


async def test_a_worker_leaving_discovery_disappears_from_answers(bus):
    nc, _service, register, registrars = bus
    await register("w1")
    await register("w2")
    e1, e2 = FakeEngine("w1"), FakeEngine("w2", "sglang")
    prompt = tokens(16)
    await publish(nc, e1, e1.relay(e1.stored(prompt)))
    await publish(nc, e2, e2.relay(e2.stored(prompt)))
    await until(nc, query(prompt), lambda r: depths(r) == {("w1", 0): 4, ("w2", 0): 4})
    await registrars.pop("w1").stop()  # deregisters: the key is deleted
    reply = await until(nc, query(prompt), lambda r: depths(r) == {("w2", 0): 4})
    assert reply.unseen == []


async def test_a_worker_back_in_discovery_is_answered_for_with_its_blocks_unless_its_engine_restarted(bus):
    """A broker outage longer than the discovery TTL (or an agent stalled that long): the worker left
    and came back with the same engine, whose cache never announces those blocks again."""
    nc, _service, register, registrars = bus
    await register("w1", started_at=100.0)
    engine = FakeEngine("w1")
    prompt = tokens(16)
    await publish(nc, engine, engine.relay(engine.stored(prompt)))
    await until(nc, query(prompt), lambda r: depths(r) == {("w1", 0): 4})
    await registrars.pop("w1").stop()
    await until(nc, query(prompt), lambda r: depths(r) == {})
    await register("w1", started_at=100.0)
    await until(nc, query(prompt), lambda r: depths(r) == {("w1", 0): 4})
    await registrars.pop("w1").stop()
    await until(nc, query(prompt), lambda r: depths(r) == {})
    await register("w1", started_at=200.0)  # another engine under the same worker id
    await until(nc, query(prompt), lambda r: r.unseen == ["w1"])
    assert depths(await ask(nc, query(prompt))) == {}


async def test_a_restarted_indexer_asks_the_agents_for_what_left_the_stream_and_holds_it_again(bus):
    """The stream keeps --kv-event-max-age of events: a prompt cached for longer is in no event the
    restarted indexer can replay. It asks every worker-agent (KvResync), whose state relay restores it."""
    nc, service, register, _ = bus
    await register("w1")
    engine = FakeEngine("w1")
    old, recent = tokens(16), tokens(8, start=9000)
    await publish(nc, engine, engine.relay(engine.stored(old)))
    await until(nc, query(old), lambda r: depths(r) == {("w1", 0): 4})
    await nc.jetstream().purge_stream(KV_EVENT_STREAM)  # its events aged out
    await publish(nc, engine, engine.relay(engine.stored(recent)))
    await service.stop()
    asked: list[str] = []

    async def agent(msg):  # what the worker-agent answers: its whole holding, at its last engine batch
        asked.append(decode(KvResync, msg.data).requester)
        held = {4: pack_hashes(block_hashes(old, 4) + block_hashes(recent, 4))}
        await nc.jetstream().publish(engine.subject, encode(KvRelay(worker_id="w1", kind="state", dp_rank=0,
                                                                    seq=engine.seq, reset=True, stored=held)))

    await nc.subscribe(KV_RESYNC, cb=agent)
    await nc.flush()
    again = KvIndexerService(KvIndexerSettings(nats_url=service.settings.nats_url, kv_event_max_age=120))
    await again.start()
    try:
        await until(nc, query(old), lambda r: depths(r) == {("w1", 0): 4})
        assert asked == ["kv-indexer"]
        assert depths(await ask(nc, query(recent))) == {("w1", 0): 2}
    finally:
        await again.stop()


async def test_events_of_a_worker_registered_later_attach_to_its_model(bus):
    nc, _service, register, _ = bus
    late = FakeEngine("late")
    prompt = tokens(8)
    await publish(nc, late, late.relay(late.stored(prompt)))
    await nc.flush()
    await asyncio.sleep(0.2)
    assert (await ask(nc, query(prompt))).overlaps == []
    await register("late")
    await until(nc, query(prompt), lambda r: depths(r) == {("late", 0): 2})


async def test_malformed_input_is_counted_and_the_service_keeps_going(bus):
    nc, service, register, _ = bus
    await register("w1")
    engine = FakeEngine("w1")
    js = nc.jetstream()
    await js.publish(engine.subject, b"\xc1 not msgpack")
    await js.publish(engine.subject, encode(KvRelay(worker_id="w1", seq=0, payload=b"junk")))
    await js.publish(engine.subject, encode(KvRelay(worker_id="w2", seq=0, payload=b"")))  # wrong subject
    prompt = tokens(12)
    await publish(nc, engine, engine.relay({"type": "Bogus"}, engine.stored(prompt)))
    await until(nc, query(prompt), lambda r: depths(r) == {("w1", 0): 3})
    malformed = {kind: service.metrics.registry.get_sample_value("infera_kv_indexer_malformed_total", {"kind": kind})
                 for kind in ("relay", "batch", "event")}
    assert malformed == {"relay": 2.0, "batch": 1.0, "event": 1.0}
    bad_query = await nc.request(KV_QUERY, b"\x01\x02", timeout=5)
    assert decode(OverlapReply, bad_query.data) == OverlapReply()
    assert depths(await ask(nc, query(prompt))) == {("w1", 0): 3}


async def test_the_stream_is_bounded_and_a_worker_agent_does_not_override_the_indexers_limits(bus):
    nc, _service, _register, _ = bus
    js = nc.jetstream()
    await ensure_kv_event_stream(js)  # what a worker-agent calls
    config = (await js.stream_info(KV_EVENT_STREAM)).config
    assert config.subjects == ["infera.kv.events.>"]
    assert (config.retention, config.storage) == (RetentionPolicy.LIMITS, StorageType.FILE)
    assert (config.max_age, config.max_bytes) == (120, KV_EVENT_MAX_BYTES)  # the indexer's --kv-event-max-age
    await ensure_kv_event_stream(js, max_age=KV_EVENT_MAX_AGE)
    assert (await js.stream_info(KV_EVENT_STREAM)).config.max_age == KV_EVENT_MAX_AGE


def test_ingest_metrics_reach_prometheus_on_the_tick_and_a_worker_that_left_keeps_no_gauge():
    from infera_common.fleet import Change

    service = KvIndexerService(KvIndexerSettings())  # not started: its handlers driven by hand
    registry = service.metrics.registry
    for wid in ("w1", "w2"):
        service._on_change(Change("join", record(wid)))
    e1, e2 = FakeEngine("w1"), FakeEngine("w2")
    e1.relay_kind = "blocks"  # as the worker-agent relays; e2's go raw
    relayed = {"w1": 1_764_000_000.5, "w2": 1_764_000_002.25}  # when each agent relayed its batch
    service._on_stream_message(e1.subject, e1.relay(e1.stored(tokens(12)), ts=relayed["w1"]))
    service._on_stream_message(e2.subject, e2.relay(e2.stored(tokens(8)), ts=relayed["w2"]))
    stored = {"op": "stored"}
    assert registry.get_sample_value("infera_kv_indexer_blocks_applied_total", stored) is None  # not yet
    service._flush_metrics()
    assert registry.get_sample_value("infera_kv_indexer_blocks_applied_total", stored) == 5
    assert registry.get_sample_value("infera_kv_indexer_relay_messages_total", {"kind": "blocks"}) == 1
    assert registry.get_sample_value("infera_kv_indexer_relay_messages_total", {"kind": "batch"}) == 1
    assert registry.get_sample_value("infera_kv_indexer_worker_blocks", {"worker": "w1"}) == 3
    # when each worker's latest events were relayed: a worker whose time stops moving has a broken event path
    last = "infera_kv_indexer_worker_last_event_timestamp_seconds"
    for wid in ("w1", "w2"):
        assert registry.get_sample_value(last, {"worker": wid}) == relayed[wid]
    service._on_stream_message(e1.subject, e1.relay(e1.removed(tokens(12), 1)))
    service._on_change(Change("leave", record("w2")))
    service._flush_metrics()
    assert registry.get_sample_value("infera_kv_indexer_worker_blocks", {"worker": "w1"}) == 1
    assert registry.get_sample_value("infera_kv_indexer_worker_blocks", {"worker": "w2"}) is None
    assert registry.get_sample_value(last, {"worker": "w2"}) is None
    assert registry.get_sample_value(last, {"worker": "w1"})
    assert registry.get_sample_value("infera_kv_indexer_blocks_applied_total", {"op": "removed"}) == 2


def test_lag_is_observed_for_live_messages_not_for_the_replay_at_start():
    from types import SimpleNamespace

    service = KvIndexerService(KvIndexerSettings())  # not started: its handler driven by hand
    engine = FakeEngine("w1")
    count = lambda: service.metrics.registry.get_sample_value("infera_kv_indexer_lag_seconds_count")  # noqa: E731
    service._stream = SimpleNamespace(replaying=True)
    service._on_stream_message(engine.subject, engine.relay(engine.stored(tokens(8))))
    assert count() == 0  # an hour-old history is no lag
    service._stream.replaying = False
    service._on_stream_message(engine.subject, engine.relay(engine.stored(tokens(8, start=3000))))
    assert count() == 1
