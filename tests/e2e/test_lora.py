"""LoRA adapters through the fleet (vLLM's ``--enable-lora --lora-modules``, in the mock engine): each
adapter is listed with its base model, requests naming it go only to the workers that serve it, and
routing finds the KV blocks that adapter computed, never the base model's for the same tokens (named
alone or in SGLang's ``<model>:<adapter>`` form, whatever the engine); an
adapter loaded or unloaded while the engine serves (vLLM's run-time endpoints) joins or leaves routing."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

import pytest

from infera.procs import free_port
from infera_common.models import BUNDLED_MODEL_NAME
from infera_router.inflight_blocks import LINGER
from tests.e2e.fleet import PLANES, Fleet, env_with, stop_with_children
from tests.e2e.runbook import http_json, wait_for

ENGINE = "--engine-flavor vllm --speedup 20"  # vLLM's flavour: a model it does not serve is a 404
#: each flavour's flags for the same two adapters; an engine without them refuses a request for one
#: (vLLM: 404 for a model it does not serve; SGLang: 400 for "<model>:<adapter>" it has not loaded)
ADAPTERS = {"vllm": "--enable-lora --lora-modules sql=/adapters/sql chat=/adapters/chat",
            "sglang": "--lora-paths sql=/adapters/sql chat=/adapters/chat"}


def _plain_worker(fleet: Fleet, plane: str, etcd_port: int, flavor: str) -> subprocess.Popen:
    """A worker without adapters, started by hand with the plane's flags."""
    planes = (["--nats-url", fleet.nats_url] if plane == "nats" else
              [*PLANES[plane], "--etcd-endpoint", f"127.0.0.1:{etcd_port}", "--advertise-host", "127.0.0.1"])
    log = open(fleet.state_dir / "plain.log", "ab")
    return subprocess.Popen(
        [sys.executable, "-m", "infera.engine.mock", *planes, "--worker-id", "plain-1", "--metrics-port", "0",
         "--served-model-name", BUNDLED_MODEL_NAME, "--speedup", "20", "--engine-flavor", flavor],
        stdout=log, stderr=subprocess.STDOUT, env=env_with(), start_new_session=True)


def _chat(fleet: Fleet, model: str, content: str, answered_as: str | None = None) -> dict:
    """A chat answer, which names the model as the fleet serves it (``answered_as``, else ``model``)."""
    status, body = http_json(fleet.url + "/v1/chat/completions", {
        "model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 2})
    assert status == 200, (model, body)
    assert body["model"] == (answered_as or model)
    return body


def _streamed_models(fleet: Fleet, model: str) -> set[str]:
    """The ``model`` of every chunk of a streamed chat answer."""
    ask = urllib.request.Request(fleet.url + "/v1/chat/completions", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"model": model, "stream": True, "max_tokens": 4,
                                                  "messages": [{"role": "user", "content": "a stream"}]}).encode())
    with urllib.request.urlopen(ask, timeout=30) as resp:
        events = [line[6:] for line in resp.read().decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) > 2
    return {json.loads(e)["model"] for e in events[:-1]}


def _cached(body: dict) -> int:
    return (body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)


@pytest.mark.parametrize("flavor", list(ADAPTERS))
@pytest.mark.parametrize("plane", list(PLANES))
def test_adapters_are_listed_routed_to_their_workers_and_to_the_cache_they_computed(tmp_path, plane, flavor):
    etcd_port = free_port()
    etcd = ["--etcd-port", str(etcd_port)] if plane == "no-broker" else []
    fleet = Fleet(tmp_path, workers=2, plane=plane, env=env_with(),
                  extra=[*etcd, f"--engine-arg=--engine-flavor {flavor} --speedup 20 {ADAPTERS[flavor]}"]).start()
    plain = None
    try:
        plain = _plain_worker(fleet, plane, etcd_port, flavor)
        wait_for(lambda: len([r for r in fleet.workers_list() if r["status"] == "active"]) == 3, 90,
                 "three active workers")
        records = {r["worker_id"]: r for r in fleet.workers_list()}
        assert records["plain-1"]["adapters"] == []
        assert sorted(r["adapters"] for w, r in records.items() if w != "plain-1") == [["sql", "chat"]] * 2
        models = {m["id"]: m for m in fleet.get_json("/v1/models")["data"]}
        assert sorted(models) == sorted([BUNDLED_MODEL_NAME, "sql", "chat"])
        assert models["sql"]["parent"] == models["chat"]["parent"] == BUNDLED_MODEL_NAME
        assert "parent" not in models[BUNDLED_MODEL_NAME]
        assert fleet.get_json("/v1/models/sql")["parent"] == BUNDLED_MODEL_NAME

        # every request naming an adapter reaches a worker that serves it (the plain one would answer 404)
        prompts = [f"adapter question {n}, long enough to fill several KV blocks of the engine " * 20
                   for n in range(4)]
        # (SGLang is sent "<model>:sql" and answers with that name: the answer names "sql" all the same)
        firsts = [_chat(fleet, "sql", p) for p in prompts]
        for n in range(6):
            _chat(fleet, "chat", f"a short one {n}")
        assert _streamed_models(fleet, "chat") == {"chat"}
        time.sleep(LINGER + 0.5)  # past the router's memory of what it sent: the index alone
        for n, (prompt, first) in enumerate(zip(prompts, firsts)):
            again = _chat(fleet, "sql", prompt)  # to the blocks the adapter computed
            assert again["usage"]["prompt_tokens"] == first["usage"]["prompt_tokens"]
            assert _cached(again) > 0, n
        # SGLang's own form, <model>:<adapter>, names the same adapter on either engine, and its blocks
        assert _cached(_chat(fleet, f"{BUNDLED_MODEL_NAME}:sql", prompts[1], "sql")) > 0
        # the base model's blocks for the same tokens are its own: its first request computes them all
        base = _chat(fleet, BUNDLED_MODEL_NAME, prompts[0])
        assert _cached(base) == 0
        status, body = http_json(fleet.url + "/v1/chat/completions", {
            "model": "nope", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert status == 404 and body["error"]["code"] == "model_not_found"
    finally:
        if plain is not None:
            stop_with_children([plain])
        fleet.stop()


def _engine_post(url: str, path: str, body: dict) -> int:
    ask = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(ask, timeout=10) as resp:
        return resp.status


#: each engine's run-time endpoints: vLLM's (with VLLM_ALLOW_RUNTIME_LORA_UPDATING), SGLang's (always)
RUNTIME = {"vllm": ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"),
           "sglang": ("/load_lora_adapter", "/unload_lora_adapter")}


@pytest.mark.parametrize("flavor", list(RUNTIME))
def test_an_adapter_loaded_at_run_time_joins_routing_and_one_unloaded_leaves_where_the_engine_drops_it(
        tmp_path, flavor):
    env = env_with(VLLM_ALLOW_RUNTIME_LORA_UPDATING="true", INFERA_MODELS_INTERVAL="0.5")
    fleet = Fleet(tmp_path, workers=2, env=env,
                  extra=[f"--engine-arg=--engine-flavor {flavor} --speedup 20 --enable-lora"]).start()
    load, unload = RUNTIME[flavor]
    try:
        engines = [r["url"] for r in fleet.workers_list()]
        assert [r["adapters"] for r in fleet.workers_list()] == [[], []]
        assert _engine_post(engines[0], load, {"lora_name": "late", "lora_path": "/a/late"}) == 200

        def listed() -> dict:
            return {m["id"]: m for m in fleet.get_json("/v1/models")["data"]}

        wait_for(lambda: "late" in listed(), 15, "the loaded adapter listed")
        assert listed()["late"]["parent"] == BUNDLED_MODEL_NAME
        for n in range(6):  # only the engine that loaded it is sent its requests (the other would refuse them)
            _chat(fleet, "late", f"a question for the adapter loaded late, number {n}")
        assert _engine_post(engines[0], unload, {"lora_name": "late"}) == 200
        if flavor == "vllm":
            wait_for(lambda: "late" not in listed(), 15, "the unloaded adapter gone from the list")
            status, body = http_json(fleet.url + "/v1/chat/completions", {
                "model": "late", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            assert status == 503, body  # served here a moment ago: unavailable now, not unknown
        else:  # SGLang loads again, when a request names it, any adapter it loaded before
            time.sleep(2)  # four reads of its /v1/models, which no longer lists it
            assert "late" in listed()
            _chat(fleet, "late", "asked after the unload")
    finally:
        fleet.stop()


def test_adapters_vllms_resolver_would_load_on_first_use_are_routed_before_any_engine_lists_them(tmp_path):
    """vLLM's filesystem LoRA resolver loads an adapter only when a request names it, so no
    ``/v1/models`` lists it before: the worker-agent reads the resolver's directory instead."""
    loras = tmp_path / "loras"
    loras.mkdir()
    env = env_with(VLLM_ALLOW_RUNTIME_LORA_UPDATING="true", VLLM_LORA_RESOLVER_CACHE_DIR=str(loras),
                   INFERA_MODELS_INTERVAL="0.5")
    fleet = Fleet(tmp_path, workers=2, env=env,
                  extra=["--engine-arg=--engine-flavor vllm --speedup 20 --enable-lora"]).start()
    try:
        engine = fleet.workers_list()[0]["url"]  # its model path, as its /v1/models says it
        with urllib.request.urlopen(engine + "/v1/models", timeout=10) as resp:
            base = json.loads(resp.read())["data"][0]["root"]
        (loras / "found").mkdir()
        (loras / "found" / "adapter_config.json").write_text(
            json.dumps({"peft_type": "LORA", "base_model_name_or_path": base}))
        wait_for(lambda: [r["adapters"] for r in fleet.workers_list()] == [["found"], ["found"]], 15,
                 "the resolvable adapter registered by both workers")
        assert fleet.get_json("/v1/models/found")["parent"] == BUNDLED_MODEL_NAME
        prompt = "a question for an adapter no engine has loaded yet, long enough for KV blocks " * 12
        assert _cached(_chat(fleet, "found", prompt)) == 0  # the engine loads it now
        time.sleep(LINGER + 0.5)
        assert _cached(_chat(fleet, "found", prompt)) > 0  # and its blocks are routed to
    finally:
        fleet.stop()
