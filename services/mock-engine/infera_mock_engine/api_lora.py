"""Run-time LoRA endpoints. vLLM's ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``
(plain-text success, OpenAI-style errors), served (as vLLM 0.32 serves them) only when
``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is true; SGLang's ``POST /load_lora_adapter`` and
``/unload_lora_adapter`` (``{"success", "error_message", "loaded_adapters"}``, 400 on failure),
always served; vLLM's filesystem resolver (``resolve``), which loads an adapter when a request first
names it. The adapters themselves are in ``lora.py``."""

from __future__ import annotations

import json
import os

from aiohttp import web
from pydantic import BaseModel

from infera_mock_engine.engine import Engine, RequestError
from infera_mock_engine.http_common import engine_of, parse_body
from infera_mock_engine.lora import LoraConfigError, LoraRegistry

RUNTIME_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
#: vLLM's filesystem resolver: the directory it looks in, and its plugin's name in ``VLLM_PLUGINS``
RESOLVER_DIR_ENV, RESOLVER = "VLLM_LORA_RESOLVER_CACHE_DIR", "lora_filesystem_resolver"


class _Load(BaseModel):
    lora_name: str = ""
    lora_path: str = ""


class _Unload(BaseModel):
    lora_name: str = ""


async def load_lora_adapter(request: web.Request) -> web.Response:
    body = await parse_body(request, _Load)
    try:
        engine_of(request).lora.load(body.lora_name, body.lora_path)
    except LoraConfigError as e:
        raise RequestError(str(e)) from None
    return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    body = await parse_body(request, _Unload)
    if not body.lora_name:
        raise RequestError("'lora_name' needs to be provided to unload a LoRA adapter.")
    if not engine_of(request).lora.unload(body.lora_name):
        raise RequestError(f"The lora adapter '{body.lora_name}' cannot be found.", status=404)
    return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


async def sglang_load(request: web.Request) -> web.Response:
    body = await parse_body(request, _Load)
    lora = engine_of(request).lora
    try:
        lora.load(body.lora_name, body.lora_path)
    except LoraConfigError as e:
        return _sglang_answer(lora, str(e))
    return _sglang_answer(lora)


async def sglang_unload(request: web.Request) -> web.Response:
    body = await parse_body(request, _Unload)
    lora = engine_of(request).lora
    if not lora.unload(body.lora_name):
        return _sglang_answer(lora, f"LoRA adapter {body.lora_name!r} is not loaded")
    return _sglang_answer(lora)


def _sglang_answer(lora: LoraRegistry, error: str | None = None) -> web.Response:
    loaded = {m.name: m.path for m in lora.modules()}
    return web.json_response({"success": error is None, "error_message": error, "loaded_adapters": loaded},
                             status=400 if error else 200)


def runtime_updates() -> bool:
    """Whether vLLM would serve the run-time endpoints (its env parse: "1" or "true")."""
    return os.environ.get(RUNTIME_ENV, "0").strip().lower() in ("1", "true")


def resolve(engine: Engine, name: str) -> bool:
    """vLLM's filesystem LoRA resolver, for a request naming ``name``, no served name: with run-time
    updates on and ``VLLM_LORA_RESOLVER_CACHE_DIR`` set (its plugin not left out of ``VLLM_PLUGINS``),
    ``<dir>/<name>/adapter_config.json`` of a LoRA for this engine's model is loaded under ``name``.
    False when nothing is found (the request is then a 404); 400 when found but not loadable."""
    directory = os.environ.get(RESOLVER_DIR_ENV)
    plugins = os.environ.get("VLLM_PLUGINS")
    if not runtime_updates() or not directory or (plugins is not None and RESOLVER not in plugins.split(",")):
        return False
    path = os.path.join(directory, name)
    try:
        with open(os.path.join(path, "adapter_config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return False
    if not isinstance(config, dict) or config.get("peft_type") != "LORA" \
            or config.get("base_model_name_or_path") != engine.config.model_path:
        return False
    try:
        engine.lora.load(name, path)
    except LoraConfigError:
        raise RequestError(f"LoRA adapter '{name}' was found but could not be loaded.", param="model") from None
    return True


def add_routes(app: web.Application, flavor: str) -> None:
    if flavor == "sglang":
        app.router.add_post("/load_lora_adapter", sglang_load)
        app.router.add_post("/unload_lora_adapter", sglang_unload)
    elif runtime_updates():
        app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
        app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
