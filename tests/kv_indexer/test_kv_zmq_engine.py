"""The kv-indexer on ``--kv-event-transport zmq`` against real mock engine processes: it reads each
engine's ZMQ publisher and replay socket itself, answers overlap queries over a real nats-server,
and never creates or reads the JetStream KV event stream."""

from __future__ import annotations

import pytest
from nats.js.errors import NotFoundError

from infera_common.discovery import Registrar
from infera_common.nats_conn import connect
from infera_common.subjects import KV_EVENT_STREAM
from infera_kv_indexer.service import KvIndexerService
from infera_kv_indexer.settings import KvIndexerSettings
from tests.kv_indexer.kv_fakes import depths, query, tokens
from tests.kv_indexer.test_kv_service import ask, until
from tests.kv_indexer.zmq_helpers import MockEngineProc, eventually, sample

PAGE = 16
PROMPT = tokens(3 * PAGE)  # three full blocks


def q(prompt=PROMPT):
    return query(prompt, block_sizes=(PAGE,))


@pytest.fixture
async def engines(model_dir, subprocess_env, tmp_path):
    started: list[MockEngineProc] = []

    async def start(flavor: str) -> MockEngineProc:
        engine = MockEngineProc(model_dir, subprocess_env, tmp_path / f"{flavor}.log", flavor, PAGE)
        started.append(engine)
        await engine.start()
        return engine

    yield start
    for engine in started:
        engine.stop()


async def test_engines_are_read_directly_rebuilt_at_start_restarted_and_dropped(nats_server, engines):
    vl, sg = await engines("vllm"), await engines("sglang")
    await vl.complete(PROMPT)  # before any indexer exists: only the engine's replay buffer has it
    nc = await connect(nats_server, "kv-test")
    js = nc.jetstream()
    regs = {"vl": Registrar(js, vl.record("vl")), "sg": Registrar(js, sg.record("sg"))}
    service = KvIndexerService(KvIndexerSettings(nats_url=nats_server, kv_event_transport="zmq"))
    try:
        for reg in regs.values():
            await reg.start()
        await service.start()
        # serving only after the first replay: the late indexer answers from a rebuilt index at once
        reply = await ask(nc, q())
        assert depths(reply) == {("vl", 0): 3} and reply.unseen == ["sg"]
        assert sample(service, "infera_kv_indexer_zmq_replayed_batches_total") >= 1
        await eventually(lambda: sample(service, "infera_kv_indexer_zmq_endpoints_connected", {"worker": "sg"}) == 1)

        await sg.complete(PROMPT[:2 * PAGE])  # live, over the SUB socket
        reply = await until(nc, q(), lambda r: depths(r) == {("vl", 0): 3, ("sg", 0): 2})
        assert reply.unseen == []

        # the sglang engine restarts on the same ports; its agent registers the new start
        sg.stop()
        await sg.start()
        regs["sg"].record = sg.record("sg", started_at=2.0)
        await regs["sg"].set_status(regs["sg"].record.status)
        await until(nc, q(), lambda r: depths(r) == {("vl", 0): 3})
        assert sample(service, "infera_kv_indexer_zmq_engine_restarts_total", {"how": "record"}) == 1
        await sg.complete(PROMPT)
        await until(nc, q(), lambda r: depths(r) == {("vl", 0): 3, ("sg", 0): 3})

        # leaving discovery drops the worker and its subscription
        await regs.pop("vl").stop()
        await until(nc, q(), lambda r: depths(r) == {("sg", 0): 3})
        await eventually(lambda: set(service._zmq.followed) == {"sg"})

        with pytest.raises(NotFoundError):  # the KV event stream was never created
            await js.stream_info(KV_EVENT_STREAM)
    finally:
        await service.stop()
        for reg in regs.values():
            await reg.stop()
        await nc.close()
