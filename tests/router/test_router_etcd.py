"""The router on ``--discovery-backend etcd``: it routes to workers registered in etcd, and says so
when a request comes from a frontend on the other discovery backend or names a model nobody serves."""

from __future__ import annotations

import asyncio

import pytest

from infera_common.discovery_etcd import EtcdRegistrar
from infera_common.nats_conn import connect, ensure_request_stream
from infera_common.schemas import RouteReply, decode, encode
from infera_common.subjects import ROUTER_ROUTE

from infera_router.service import RouterService
from infera_router.settings import RouterSettings

from router_helpers import record, route_request


async def _route(nc, **kw) -> RouteReply:
    return decode(RouteReply, (await nc.request(ROUTER_ROUTE, encode(route_request(**kw)), timeout=5)).data)


async def test_router_routes_workers_registered_in_etcd(nats_server, etcd_server):
    router = RouterService(RouterSettings(nats_url=nats_server, discovery_backend="etcd",
                                          etcd_endpoint=etcd_server.endpoint, router_policy="round-robin"))
    await router.start()
    nc = await connect(nats_server, "test-client")
    reg = EtcdRegistrar(etcd_server.endpoint, record("w1"))
    try:
        await ensure_request_stream(nc.jetstream(), "w1", 4, max_age=60)
        await reg.start()
        for _ in range(100):
            if router.core.fleet.get("w1") is not None:
                break
            await asyncio.sleep(0.05)
        reply = await _route(nc)
        assert (reply.status, reply.worker_id) == (200, "w1")
        # a frontend following the NATS bucket sees another fleet: refused, naming the flag
        mixed = await _route(nc, request_id="r2", discovery_backend="nats")
        assert mixed.status == 503 and "--discovery-backend" in mixed.message and "etcd" in mixed.message
        unknown = await _route(nc, request_id="r3", model="other", discovery_backend="etcd")
        assert unknown.status == 404 and f"etcd at {etcd_server.endpoint}" in unknown.message
    finally:
        await reg.stop()
        await nc.close()
        await router.stop()


async def test_unreachable_etcd_fails_at_start_naming_the_endpoint(nats_server):
    router = RouterService(RouterSettings(nats_url=nats_server, discovery_backend="etcd",
                                          etcd_endpoint="127.0.0.1:1"))
    with pytest.raises(ConnectionError, match="--etcd-endpoint"):
        await router.start()
    await router.stop()
