"""Frontend fixtures: the frontend in-process with a fake router + worker-agent (frontend_fakes)."""

from __future__ import annotations

import pytest

from infera_common.discovery import Registrar
from infera_common.nats_conn import connect, flush_all
from infera_common.subjects import (
    ROUTER_QUEUE, ROUTER_ROUTE, cancel_subject, frames_query_subject, frames_replay_subject,
    router_frames_query_subject, router_frames_replay_subject,
)
from infera_frontend.service import Frontend
from infera_frontend.settings import FrontendSettings
from tests.frontend.frontend_fakes import (
    MODEL, W1, W2, W3, WORKER, FakeFleet, MultiFleet, wait_until, worker_record,
)


@pytest.fixture
async def fleet(nats_server):
    """A fake router + worker-agent for worker ``w1`` serving ``MODEL`` (registered in discovery)."""
    nc = await connect(nats_server, "fake-fleet")
    fake = FakeFleet(nc)
    await nc.subscribe(ROUTER_ROUTE, queue=ROUTER_QUEUE, cb=fake.on_route)
    await nc.subscribe(cancel_subject(WORKER), cb=fake.on_cancel)
    registrar = Registrar(nc.jetstream(), worker_record())
    await registrar.start()
    await flush_all(nc)
    yield fake
    for t in list(fake.tasks):
        t.cancel()
    await registrar.stop()
    await nc.close()


@pytest.fixture
async def make_frontend(nats_server):
    """Start a frontend in-process on a free port (settings overridable); stopped after the test."""
    started: list[Frontend] = []

    async def start(**overrides) -> Frontend:
        values = {"nats_url": nats_server, "port": 0, "upstream_timeout": 2.0, "route_timeout": 1.0, **overrides}
        fe = Frontend(FrontendSettings(**values))
        await fe.start()
        started.append(fe)
        await wait_until(lambda: not fe.not_ready())
        return fe

    yield start
    for fe in started:
        await fe.stop()


@pytest.fixture
async def frontend(make_frontend, fleet):
    """A frontend whose discovery view already shows worker w1 as active."""
    fe = await make_frontend()
    await wait_until(lambda: fe.models.is_known(MODEL))
    return fe




@pytest.fixture(scope="session")
def tok_ids_1plus1() -> list[int]:
    """The bundled tokenizer's ids for one user message "1+1=?" (chat template applied)."""
    from infera_common.models import default_model_path
    from infera_common.tokenizer import ChatTokenizer

    return ChatTokenizer.from_dir(default_model_path()).chat_ids([{"role": "user", "content": "1+1=?"}])


@pytest.fixture
async def multi(nats_server):
    """A fake router over fake workers w1, w2, w3 (tried in that order, ``exclude`` honoured)."""
    nc = await connect(nats_server, "fake-multi-fleet")
    fleet = MultiFleet(nc, [W1, W2, W3])
    await nc.subscribe(ROUTER_ROUTE, queue=ROUTER_QUEUE, cb=fleet.on_route)
    registrars = []
    for w in fleet.workers:
        await nc.subscribe(cancel_subject(w), cb=fleet.cancel_handler(w))
        fleet.query_subs[w] = await nc.subscribe(frames_query_subject(w), cb=fleet.frames_handler(w))
        await nc.subscribe(frames_replay_subject(w), cb=fleet.replay_handler(w))
        registrars.append(Registrar(nc.jetstream(), worker_record(w)))
        await registrars[-1].start()
    # the router's own subjects, asked when its route replies say it sends the frames itself
    fleet.query_subs["r1"] = await nc.subscribe(router_frames_query_subject("r1"), cb=fleet.frames_handler("r1"))
    await nc.subscribe(router_frames_replay_subject("r1"), cb=fleet.replay_handler("r1"))
    await flush_all(nc)
    yield fleet
    for t in list(fleet.tasks):
        t.cancel()
    for r in registrars:
        await r.stop()
    await nc.close()


@pytest.fixture
async def start_frontend(make_frontend, multi):
    async def start(**overrides):
        fe = await make_frontend(**overrides)
        await wait_until(lambda: fe.models.is_known(MODEL))
        return fe
    return start
