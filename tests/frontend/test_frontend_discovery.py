"""The frontend's discovery backend: etcd works like NATS, and a plane mix is named, not waited out."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from infera_common.discovery_select import Discovery
from infera_common.fleet import Change
from infera_common.nats_conn import connect
from infera_common.schemas import LoadReport, WorkerRecord, WorkerStatus, encode
from infera_common.subjects import ROUTER_QUEUE, ROUTER_ROUTE, load_subject
from infera_frontend.prepare import ModelTable
from infera_frontend.validation import ApiError
from tests.frontend.frontend_fakes import MODEL, WORKER, FakeFleet, chat_body, url, wait_until, worker_record


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _error(table: ModelTable, model: str) -> ApiError | None:
    try:
        table.check(model)
    except ApiError as err:
        return err
    return None


def _rec(wid: str, model: str = "m") -> WorkerRecord:
    return WorkerRecord(worker_id=wid, model=model, engine="mock", url="http://x", advertise_host="x",
                        status=WorkerStatus.ACTIVE)


def _report(wid: str, model: str = "m", backend: str | None = "etcd", endpoint: str = "10.0.0.10:2379") -> LoadReport:
    return LoadReport(worker_id=wid, in_flight=0, model=model, discovery_backend=backend, etcd_endpoint=endpoint)


def test_an_unknown_model_names_the_discovery_the_frontend_follows():
    err = _error(ModelTable("nats (JetStream KV bucket infera_workers)"), "m")
    assert err.status == 404 and err.code == "model_not_found"
    assert "nats (JetStream KV bucket infera_workers)" in err.message


def test_a_model_served_only_by_workers_registered_elsewhere_is_a_503_naming_the_flags():
    clock = Clock()
    table = ModelTable("nats (JetStream KV bucket infera_workers)", clock=clock)
    assert table.unlisted.saw(_report("e1"), table.lists("e1"), clock.now)  # first sight: worth a log line
    assert not table.unlisted.saw(_report("e1"), table.lists("e1"), clock.now + 1)  # not twice
    clock.now += 1
    err = _error(table, "m")
    assert err.status == 503 and err.code == "discovery_mismatch"
    assert "e1" in err.message and "etcd at 10.0.0.10:2379" in err.message
    assert "--discovery-backend" in err.message and "--etcd-endpoint" in err.message
    assert _error(table, "other").status == 404  # only the model those workers serve
    # reports stop (the worker is gone): after the window the model is simply unknown again
    clock.now += table.unlisted.window + 1
    assert _error(table, "m").status == 404


def test_a_worker_discovery_lists_or_listed_once_is_no_plane_mix():
    clock = Clock()
    table = ModelTable("etcd at 127.0.0.1:2379", clock=clock)
    table.apply(Change("join", _rec("a")))
    assert not table.unlisted.saw(_report("a", backend="etcd"), table.lists("a"), clock.now)
    assert _error(table, "m") is None
    table.apply(Change("leave", _rec("a")))
    # the last load report of a leaving worker trails its deregistration: still no mix
    table.unlisted.saw(_report("a", backend="etcd"), table.lists("a"), clock.now)
    err = _error(table, "m")
    assert err.status == 503 and err.code != "discovery_mismatch"
    assert "every worker that served it has left" in err.message


async def test_frontend_on_etcd_lists_serves_and_names_a_worker_registered_in_nats(
    nats_server, etcd_server, make_frontend,
):
    nc = await connect(nats_server, "fake-fleet")
    fake = FakeFleet(nc)
    await nc.subscribe(ROUTER_ROUTE, queue=ROUTER_QUEUE, cb=fake.on_route)
    reg = Discovery("etcd", etcd_server.endpoint).registrar(worker_record())  # as a worker-agent does
    await reg.start()
    try:
        fe = await make_frontend(discovery_backend="etcd", etcd_endpoint=etcd_server.endpoint)
        await wait_until(lambda: fe.models.is_known(MODEL))
        async with aiohttp.ClientSession() as http:
            async with http.get(url(fe, "/v1/workers")) as resp:
                listing = await resp.json()
            assert [(w["worker_id"], w["discovery_backend"]) for w in listing["data"]] == [(WORKER, "etcd")]
            assert listing["discovery"]["discovery_backend"] == "etcd"
            assert listing["discovery"]["etcd_endpoint"] == etcd_server.endpoint
            async with http.post(url(fe, "/v1/chat/completions"), json=chat_body()) as resp:
                assert resp.status == 200
            assert fake.routed[-1].discovery_backend == "etcd"  # the router can refuse another plane

            # a running worker registered in the NATS bucket reports load: this frontend cannot see it
            stray = LoadReport(worker_id="nats-1", in_flight=0, model="other-model", discovery_backend="nats")
            deadline = time.monotonic() + 5
            while "nats-1" not in [u.worker_id for u in fe.models.unlisted.current(time.monotonic())]:
                assert time.monotonic() < deadline
                await nc.publish(load_subject("nats-1"), encode(stray))
                await nc.flush()
                await asyncio.sleep(0.05)
            async with http.post(url(fe, "/v1/chat/completions"), json=chat_body(model="other-model")) as resp:
                assert resp.status == 503
                err = (await resp.json())["error"]
            assert err["code"] == "discovery_mismatch" and "nats-1" in err["message"]
            assert f"etcd at {etcd_server.endpoint}" in err["message"] and "--discovery-backend" in err["message"]
            async with http.get(url(fe, "/v1/workers")) as resp:
                listing = await resp.json()
            assert [u["worker_id"] for u in listing["not_in_discovery"]] == ["nats-1"]
    finally:
        await reg.stop()
        await nc.close()


async def test_frontend_refuses_to_start_when_etcd_is_unreachable(nats_server):
    from infera_frontend.service import Frontend
    from infera_frontend.settings import FrontendSettings

    fe = Frontend(FrontendSettings(nats_url=nats_server, port=0, discovery_backend="etcd",
                                   etcd_endpoint="127.0.0.1:1"))
    try:
        with pytest.raises(RuntimeError, match=r"127\.0\.0\.1:1.*--etcd-endpoint|--etcd-endpoint.*127\.0\.0\.1:1"):
            await fe.start()
    finally:
        await fe.stop()
