"""Health, model/server info, model list, load and metrics endpoints."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from datetime import datetime, timezone
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry

from infera_mock_engine import __version__
from infera_mock_engine.engine import Engine, GenerationParams, RequestError
from infera_mock_engine.ranks import EngineRank
from infera_mock_engine.http_common import engine_of, json_response
from infera_mock_engine.metrics import render

REGISTRY = web.AppKey("registry", CollectorRegistry)
STARTED = web.AppKey("started", float)
#: SGLang's SGLANG_HEALTH_CHECK_TIMEOUT: how long a generation probe waits for the scheduler
HEALTH_CHECK_TIMEOUT_ENV, HEALTH_CHECK_TIMEOUT_DEFAULT = "SGLANG_HEALTH_CHECK_TIMEOUT", 20.0
#: SGLang's switch between a /health that generates (default) and one that only says the server is up
HEALTH_GENERATION_ENV = "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"
HEALTH_POLL = 0.02


def health_check_timeout() -> float:
    try:
        return float(os.environ.get(HEALTH_CHECK_TIMEOUT_ENV, HEALTH_CHECK_TIMEOUT_DEFAULT))
    except ValueError:
        return HEALTH_CHECK_TIMEOUT_DEFAULT


def health_generates() -> bool:
    # SGLang's EnvBool: these are false, true/1/yes/y true (anything else stops SGLang at start)
    return os.environ.get(HEALTH_GENERATION_ENV, "true").strip().lower() not in ("0", "false", "no", "n")


async def health(request: web.Request) -> web.Response:
    """vLLM: 200 while the engine lives (a hung GPU included). SGLang: the generation probe of
    /health_generate, unless SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION is off."""
    engine = engine_of(request)
    if not engine.ready.is_set():
        return web.Response(status=503)
    if engine.config.engine_flavor == "vllm" or not health_generates():
        return web.Response(status=200)
    return await generation_probe(engine)


async def health_generate(request: web.Request) -> web.Response:
    engine = engine_of(request)
    if not engine.ready.is_set():
        return web.Response(status=503)
    return await generation_probe(engine)


async def generation_probe(engine: Engine) -> web.Response:
    """SGLang's test: queue a one-token generation and answer 200 as soon as any scheduler step
    after this moment produced output (this probe's or any other request's), 503 when none did
    within SGLANG_HEALTH_CHECK_TIMEOUT (a hung GPU)."""
    before = [rank.scheduler.outputs for rank in engine.ranks]
    bos = engine.tokenizer.special.get("bos_token")
    first = engine.tokenizer.tokenizer.token_to_id(bos) if bos else None
    params = GenerationParams(rid=f"HEALTH_CHECK_{uuid.uuid4().hex}", prompt_ids=[first or 0], max_new_tokens=1,
                              temperature=0.0, internal=True)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + health_check_timeout()
    try:
        async with engine.submit(params):
            while loop.time() < deadline:
                if any(rank.scheduler.outputs > n for rank, n in zip(engine.ranks, before)):
                    return web.Response(status=200)
                await asyncio.sleep(HEALTH_POLL)
    except RequestError:
        pass
    return web.Response(status=503)


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


def _load(engine: Engine, rank: EngineRank) -> dict[str, Any]:
    s, kv = rank.scheduler, rank.kv
    return {
        "dp_rank": rank.dp_rank,
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


def _kv_events(engine: Engine) -> dict[str, Any] | None:
    """SGLang's `kv_events` descriptor (host, port base, dp_size), with every rank's bound endpoints."""
    pubs = engine.publishers
    if not pubs:
        return None
    desc = pubs[0].descriptor(dp_size=engine.config.dp_size)
    desc["endpoints"] = [p.bound_endpoint for p in pubs]
    desc["replay_endpoints"] = [p.bound_replay_endpoint for p in pubs]
    return desc


def _disaggregation(engine: Engine) -> dict[str, Any]:
    if engine.pd is not None:
        return engine.pd.info()
    return {"mode": "null", "protocol": None, "bootstrap_host": None, "bootstrap_port": None}


async def server_info(request: web.Request) -> web.Response:
    engine = engine_of(request)
    info = engine.config.public()
    pd = _disaggregation(engine)
    info.update(
        version=f"infera-mock-{__version__}",
        is_mock=True,
        dp_size=engine.config.dp_size,
        tp_size=1,
        disaggregation_mode=pd["mode"],
        disaggregation_bootstrap_port=pd["bootstrap_port"] or engine.config.disagg.bootstrap_port,
        disaggregation=pd,
        kv_events=_kv_events(engine),
        status="ready" if engine.ready.is_set() else "starting",
        uptime_s=time.monotonic() - request.app[STARTED],
        internal_states=[_load(engine, rank) for rank in engine.ranks],
    )
    return json_response(info)


async def models(request: web.Request) -> web.Response:
    engine = engine_of(request)
    cfg = engine.config
    owner = "vllm" if cfg.engine_flavor == "vllm" else "sglang"
    created = int(time.time())
    data = [
        {"id": name, "object": "model", "created": created, "owned_by": owner, "root": cfg.model_path,
         "parent": None, "max_model_len": cfg.context_length}
        for name in cfg.served_model_names
    ]
    data += [{"id": m.name, "object": "model", "created": created, "owned_by": owner, "root": m.path,
              "parent": m.base_model_name or cfg.served_model_name, "max_model_len": None}
             for m in engine.lora.modules()]
    return json_response({"object": "list", "data": data})


async def loads(request: web.Request) -> web.Response:
    """SGLang /v1/loads: per-DP-rank loads plus an aggregate."""
    engine = engine_of(request)
    per_rank = [_load(engine, rank) for rank in engine.ranks]
    n = len(per_rank)
    return json_response({
        "timestamp": datetime.now(timezone.utc).isoformat(),
        "version": f"infera-mock-{__version__}",
        "dp_rank_count": n,
        "loads": per_rank,
        "aggregate": {
            "total_running_reqs": sum(x["num_running_reqs"] for x in per_rank),
            "total_waiting_reqs": sum(x["num_waiting_reqs"] for x in per_rank),
            "total_reqs": sum(x["num_total_reqs"] for x in per_rank),
            "total_used_tokens": sum(x["num_used_tokens"] for x in per_rank),
            "avg_token_usage": sum(x["token_usage"] for x in per_rank) / n,
        },
    })


async def get_load(request: web.Request) -> web.Response:
    """SGLang's older /get_load: a list with one entry per DP rank."""
    engine = engine_of(request)
    return json_response([{"dp_rank": r.dp_rank, "num_reqs": r.scheduler.num_running + r.scheduler.num_waiting,
                           "num_waiting_reqs": r.scheduler.num_waiting, "num_tokens": r.kv.used_blocks * r.kv.page_size}
                          for r in engine.ranks])


async def vllm_load(request: web.Request) -> web.Response:
    """vLLM /load: requests in flight."""
    t = engine_of(request).totals()
    return json_response({"server_load": t.running + t.waiting + t.pd_pending})


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
