"""Prefix-cache control and KV-event discovery: SGLang /flush_cache, vLLM /reset_prefix_cache and
/kv_event_sources. Served in both flavours."""

from __future__ import annotations

from aiohttp import web

from infera_mock_engine.http_common import engine_of, json_response

FLUSHED = ("Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
           "requests, the operation will not be performed.)\n")


async def flush_cache(request: web.Request) -> web.Response:
    """SGLang: 200 when flushed, 400 while requests are running or waiting (the cache is kept)."""
    ok = engine_of(request).flush_cache()
    return web.Response(text=FLUSHED, status=200 if ok else 400)


async def reset_prefix_cache(request: web.Request) -> web.Response:
    """vLLM: always 200 (vLLM does not report whether the reset happened: it is refused while blocks
    are in use); `?reset_running_requests=true` preempts running requests first."""
    preempt = request.query.get("reset_running_requests", "false").lower() in ("1", "true", "yes")
    engine_of(request).reset_prefix_cache(preempt)
    return web.Response(status=200)


async def kv_event_sources(request: web.Request) -> web.Response:
    """vLLM 0.32: a map from DP rank (a string) to that rank's events config, with the endpoints
    bound (``{}`` when none publishes). (Earlier vLLM gave a bare array; the agent reads both.)"""
    return json_response({str(p.dp_rank): p.source() for p in engine_of(request).publishers})


def add_routes(app: web.Application) -> None:
    r = app.router
    r.add_post("/flush_cache", flush_cache)
    r.add_get("/flush_cache", flush_cache)
    r.add_post("/reset_prefix_cache", reset_prefix_cache)
    r.add_get("/kv_event_sources", kv_event_sources)
