"""``python -m infera.server``: the frontend, the router and the KV index as one command (the runbooks' server).

The three are the same services that run as separate processes on the NATS plane, started in one
process. They keep talking in NATS's shape (route request/reply, reply inboxes, index queries):

- on the no-broker plane (``--discovery-backend etcd --request-transport http --kv-event-transport
  zmq``) through an in-process bus (``infera_common.local_bus``): no NATS server is needed. The
  router calls the engines' HTTP APIs itself, the index reads the engines' ZMQ publishers itself,
  discovery is etcd;
- when any plane is ``nats``, each connects to ``--nats-url`` as its stand-alone process would.

``/metrics`` on ``--port`` shows the series of all three (and ``--metrics-port`` N also serves them
there). A wrong flag exits 2 at once, naming it; etcd or NATS unreachable exits 1 within seconds.
"""

from __future__ import annotations

import sys
from typing import Any

from prometheus_client import CollectorRegistry

from infera_common.local_bus import LocalBus
from infera_common.metrics import start_metrics_server
from infera_common.runtime import configure_observability, event_loop_runner, run_until_signal
from infera_common.settings import parse_cli
from infera_frontend.metrics import FrontendMetrics
from infera_frontend.service import Frontend
from infera_kv_indexer.metrics import KvIndexerMetrics
from infera_kv_indexer.service import KvIndexerService
from infera_router.metrics import RouterMetrics
from infera_router.service import RouterService

from infera.server_settings import ServerSettings

#: The in-process bus carries whole request bodies (with their token ids): no broker limit applies.
BUS_MAX_PAYLOAD = 256 << 20


class Server:
    """The three services in start order (index, router, frontend) and the bus between them."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.registry = CollectorRegistry()
        self.bus: LocalBus | None = None
        if not settings.needs_nats():
            self.bus = LocalBus(max_payload=BUS_MAX_PAYLOAD, name="infera-server", registry=self.registry)
            # nobody outside this process can reach the NATS API of an in-process bus
            settings = settings.model_copy(update={"enable_nats_api": False})
        self.indexer = KvIndexerService(settings, KvIndexerMetrics(self.registry), nc=self._client("kv-indexer"))
        self.router = RouterService(settings, RouterMetrics(self.registry), nc=self._client("router"))
        self.frontend = Frontend(settings, nc=self._client("frontend"), metrics=FrontendMetrics(self.registry))
        self._metrics_runner: Any = None
        self.metrics_port: int | None = None  # the separate /metrics endpoint's, when --metrics-port is given

    def _client(self, name: str):
        return self.bus.connect(name) if self.bus is not None else None

    @property
    def port(self) -> int | None:
        return self.frontend.port

    async def start(self) -> None:
        await self.indexer.start()
        await self.router.start()
        await self.frontend.start()
        if (port := self.settings.metrics_bind_port()) is not None:  # a separate endpoint, besides --port's
            self._metrics_runner, self.metrics_port = await start_metrics_server(
                self.registry, self.settings.metrics_host, port)

    async def stop(self) -> None:
        """Frontend first (it refuses new requests and drains those under way for --drain-timeout,
        cancelling what is left), then router, then index."""
        for part in (self.frontend, self.router, self.indexer):
            try:
                await part.stop()
            except Exception as exc:  # one part failing to stop must not keep the others running
                print(f"infera.server: stopping {type(part).__name__} failed: {exc!r}", file=sys.stderr)
        if self._metrics_runner is not None:
            await self._metrics_runner.cleanup()
        if self.bus is not None:
            await self.bus.close()


def describe(settings: ServerSettings, port: int | None, metrics_port: int | None = None) -> str:
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::", "") else settings.host
    planes = (f"discovery {settings.discovery_backend}"
              + (f" at {settings.etcd_endpoint}" if settings.discovery_backend == "etcd" else "")
              + f", requests over {settings.request_transport}, KV events over {settings.kv_event_transport}")
    metrics = (f"; /metrics also on http://{settings.metrics_host}:{metrics_port}/metrics"
               if metrics_port is not None else "")
    return (f"infera.server: serving the OpenAI API on http://{host}:{port} ({planes}; router "
            f"{settings.router_policy}{metrics})\n  curl http://{host}:{port}/v1/workers")


async def serve(settings: ServerSettings) -> int:
    server = Server(settings)
    return await run_until_signal(
        server, name="infera.server",
        on_started=lambda: print(describe(settings, server.port, server.metrics_port), flush=True))


def main(argv: list[str] | None = None) -> int:
    settings, _ = parse_cli(ServerSettings, argv, prog="python -m infera.server", description=__doc__)
    configure_observability(settings, "server")
    with event_loop_runner() as runner:
        return runner.run(serve(settings))


if __name__ == "__main__":
    raise SystemExit(main())
