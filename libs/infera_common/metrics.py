"""Prometheus exposition for services: a per-service registry and a tiny /metrics HTTP server."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, disable_created_metrics, generate_latest

# no ``<counter>_created`` sample beside every counter and histogram series (a gauge of the series'
# creation time, which doubled the series a scrape stores and no dashboard here reads)
disable_created_metrics()


def metrics_response(registry: CollectorRegistry) -> web.Response:
    resp = web.Response(body=generate_latest(registry))
    resp.content_type = CONTENT_TYPE_LATEST.split(";")[0]
    return resp


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def start_metrics_server(registry: CollectorRegistry, host: str, port: int,
                               routes: Mapping[str, Handler] | None = None) -> tuple[web.AppRunner, int]:
    """Serve ``/metrics`` (and ``/health``, and the GET ``routes`` given) for a service without its own
    HTTP server.

    ``port`` 0 picks a free port; the bound port is returned.
    """
    app = web.Application()
    app.router.add_get("/metrics", lambda _req: metrics_response(registry))
    app.router.add_get("/health", lambda _req: web.json_response({"status": "ok"}))
    for path, handler in (routes or {}).items():
        app.router.add_get(path, handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, bound
