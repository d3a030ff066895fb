"""Health, model/server info, model list, load and metrics endpoints."""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import datetime, timezone
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry

from infera_mock_engine import __version__
from infera_mock_engine.engine import Engine, GenerationParams, RequestError
from infera_mock_engine.http_common import engine_of, json_response
from infera_mock_engine.metrics import render

REGISTRY = web.AppKey("registry", CollectorRegistry)
STARTED = web.AppKey("started", float)
HEALTH_GENERATE_TIMEOUT = 20.0


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200 if engine_of(request).ready.is_set() else 503)


async def health_generate(request: web.Request) -> web.Response:
    """Generate one token through the scheduler (skipped, like SGLang, while requests are running)."""
    engine = engine_of(request)
    if not engine.ready.is_set():
        return web.Response(status=503)
    if engine.scheduler.num_running:
        return web.Response(status=200)
    bos = engine.tokenizer.special.get("bos_token")
    first = engine.tokenizer.tokenizer.token_to_id(bos) if bos else None
    params = GenerationParams(rid=f"HEALTH_CHECK_{uuid.uuid4().hex}", prompt_ids=[first or 0], max_new_tokens=1,
                              temperature=0.0, internal=True)
    try:
        async with engine.submit(params) as stream:
            await asyncio.wait_for(stream.collect(), HEALTH_GENERATE_TIMEOUT)
    except (RequestError, asyncio.TimeoutError):
        return web.Response(status=503)
    return web.Response(status=200)


async def model_info(request: web.Request) -> web.Response:
    cfg = engine_of(request).config
    return json_response({
        "model_path": cfg.model_path,
        "tokenizer_path": cfg.tokenizer_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": cfg.model_config.get("model_type"),
        "architectures": cfg.model_config.get("architectures"),
        "served_model_name": cfg.served_model_name,
    })


def _load(engine: Engine) -> dict[str, Any]:
    s, kv = engine.scheduler, engine.kv
    return {
        "dp_rank": 0,
        "num_running_reqs": s.num_running,
        "num_waiting_reqs": s.num_waiting,
        "num_total_reqs": s.num_running + s.num_waiting,
        "num_used_tokens": kv.used_blocks * kv.page_size,
        "max_total_num_tokens": kv.capacity_tokens,
        "token_usage": kv.usage,
        "num_cached_blocks": kv.cached_blocks,
        "num_evictable_tokens": kv.evictable_blocks * kv.page_size,
        "cache_hit_rate": (s.stats.cached_tokens / s.stats.prompt_tokens) if s.stats.prompt_tokens else 0.0,
        "max_running_requests": engine.config.max_running_requests,
    }


async def server_info(request: web.Request) -> web.Response:
    engine = engine_of(request)
    info = engine.config.public()
    info.update(
        version=f"infera-mock-{__version__}",
        is_mock=True,
        dp_size=1,
        tp_size=1,
        disaggregation_mode="null",
        kv_events=engine.publisher.descriptor() if engine.publisher is not None else None,
        status="ready" if engine.ready.is_set() else "starting",
        uptime_s=time.monotonic() - request.app[STARTED],
        internal_states=[_load(engine)],
    )
    return json_response(info)


async def models(request: web.Request) -> web.Response:
    cfg = engine_of(request).config
    owner = "vllm" if cfg.engine_flavor == "vllm" else "sglang"
    created = int(time.time())
    data = [
        {"id": name, "object": "model", "created": created, "owned_by": owner, "root": cfg.model_path,
         "parent": None, "max_model_len": cfg.context_length}
        for name in cfg.served_model_names
    ]
    return json_response({"object": "list", "data": data})


async def loads(request: web.Request) -> web.Response:
    """SGLang /v1/loads: per-DP-rank loads plus an aggregate."""
    engine = engine_of(request)
    load = _load(engine)
    return json_response({
        "timestamp": datetime.now(timezone.utc).isoformat(),
        "version": f"infera-mock-{__version__}",
        "dp_rank_count": 1,
        "loads": [load],
        "aggregate": {
            "total_running_reqs": load["num_running_reqs"],
            "total_waiting_reqs": load["num_waiting_reqs"],
            "total_reqs": load["num_total_reqs"],
            "total_used_tokens": load["num_used_tokens"],
            "avg_token_usage": load["token_usage"],
        },
    })


async def get_load(request: web.Request) -> web.Response:
    """SGLang's older /get_load: a list with one entry per DP rank."""
    engine = engine_of(request)
    s = engine.scheduler
    return json_response([{"dp_rank": 0, "num_reqs": s.num_running + s.num_waiting,
                           "num_waiting_reqs": s.num_waiting, "num_tokens": engine.kv.used_blocks * engine.kv.page_size}])


async def vllm_load(request: web.Request) -> web.Response:
    """vLLM /load: requests in flight."""
    s = engine_of(request).scheduler
    return json_response({"server_load": s.num_running + s.num_waiting})


async def metrics(request: web.Request) -> web.Response:
    body, content_type = render(request.app[REGISTRY], request.headers.get("Accept"))
    return web.Response(body=body, headers={"Content-Type": content_type})


def add_routes(app: web.Application) -> None:
    r = app.router
    r.add_get("/health", health)
    r.add_get("/health_generate", health_generate)
    for path in ("/model_info", "/get_model_info"):
        r.add_get(path, model_info)
    for path in ("/server_info", "/get_server_info"):
        r.add_get(path, server_info)
    r.add_get("/v1/models", models)
    r.add_get("/v1/loads", loads)
    r.add_get("/get_load", get_load)
    r.add_get("/load", vllm_load)
    r.add_get("/metrics", metrics)
