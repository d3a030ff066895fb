"""Proof against a real vLLM engine on the CPU (issue 5).

The worker-agent launches a real vLLM (``vllm-cpu``, installed by ``make vllm-cpu`` in its own venv
``.venv-vllm``; ``--engine-python`` points the agent at it) over a tiny model the test writes: a
2-layer Llama config (hidden 128, head_dim 64) with the bundled SmolLM2 tokenizer and dummy
weights (``--load-format dummy``). With nats-server, kv-indexer, a kv-aware router and the
frontend as real processes on free 127.0.0.1 ports, the test shows that the engine registers,
serves a chat completion through frontend and router with the frontend's token count matching the
engine's, and that its real KV events reach the kv-indexer so that a repeated prompt is routed as a
cache hit (router ``infera_router_kv_hit_blocks``) and served from vLLM's prefix cache
(``usage.prompt_tokens_details.cached_tokens``).

A LoRA adapter (``--enable-lora --lora-modules``, a rank-8 adapter the test writes:
``tiny_model.py``) is listed with its base model, a prompt under it is routed to the cache it
computed, and the same tokens asked of the base model get no hit from it. A second adapter lies only
in the directory of vLLM's filesystem LoRA resolver (``VLLM_LORA_RESOLVER_CACHE_DIR``): vLLM does not
list it, the agent registers it, and the first request for it, routed there, has vLLM load it.

The same runs on the no-broker plane: etcd, one ``python -m infera.server`` whose router calls vLLM's
HTTP API itself and whose index reads vLLM's ZMQ publisher directly (no nats-server at all).

Skipped when the vLLM interpreter (``INFERA_TEST_VLLM_PYTHON``, default ``.venv-vllm/bin/python``)
is missing or cannot import vllm. ``make test-slow`` runs it; it takes about a minute or two.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import pytest
from tokenizers import Tokenizer

from infera.procs import free_port, stop_process, wait_port
from infera_worker_agent.engine_gpus import gpus_needed
from infera_worker_agent.health import Canary, send_canary
from infera_worker_agent.load import parse_engine_metrics
from tests.slow.tiny_model import ADAPTER, chat_token_count, write_adapter, write_tiny_model

LATE = "late-lora"  # an adapter in vLLM's filesystem resolver's directory, not on its command line

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = os.environ.get("INFERA_TEST_VLLM_PYTHON", str(ROOT / ".venv-vllm" / "bin" / "python"))
MODEL_NAME = "tiny-llama"
ALIAS = "tiny-llama-latest"  # a second --served-model-name: vLLM lists it in /v1/models, Infera routes it
ENGINE_KEY = "sk-vllm-engine-7e1"  # the engine's --api-key: sent by the worker-agent, or the router (http)
ENGINE_AUTH = {"Authorization": f"Bearer {ENGINE_KEY}"}
WORKER_ID = "vllm-cpu-1"
BLOCK_SIZE = 32
START_TIMEOUT = 300.0  # the engine starts in ~30-60 s on 2 cores; generous for a loaded machine

def vllm_python() -> str:
    """The interpreter holding vLLM, or skip with the reason and the fix."""
    if not Path(VLLM_PYTHON).exists():
        pytest.skip(f"no vLLM interpreter at {VLLM_PYTHON}: run `make vllm-cpu` (or set INFERA_TEST_VLLM_PYTHON)")
    has_vllm = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    probe = subprocess.run([VLLM_PYTHON, "-c", has_vllm], capture_output=True, timeout=60)
    if probe.returncode != 0:
        pytest.skip(f"vllm is not installed for {VLLM_PYTHON}: run `make vllm-cpu`")
    return VLLM_PYTHON


def kv_cache_dtype_args() -> list[str]:
    """Keep the recipe's ``--kv-cache-dtype fp8_e4m3`` default where vLLM's CPU backend has FP8 KV
    (x86 with AVX-512 or AMX); elsewhere it refuses FP8 KV, so the test asks for ``auto``."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        flags = ""
    return [] if re.search(r"\b(avx512f|amx_tile)\b", flags) else ["--kv-cache-dtype", "auto"]


class Procs:
    """Child processes with their output in files; stopped together, last started first."""

    def __init__(self, logdir: Path, env: dict[str, str]) -> None:
        self.logdir = logdir
        self.env = env
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        with open(self.log_path(name), "wb") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env or self.env,
                                    start_new_session=True)
        self.procs[name] = proc
        return proc

    def log_path(self, name: str) -> Path:
        return self.logdir / f"{name}.log"

    def tail(self, name: str, lines: int = 60) -> str:
        text = self.log_path(name).read_text(errors="replace") if self.log_path(name).exists() else ""
        return f"--- {name} (last {lines} lines)\n" + "\n".join(text.splitlines()[-lines:])

    def tails(self) -> str:
        return "\n".join(self.tail(n) for n in self.procs)

    def stop_all(self) -> None:
        for name in reversed(list(self.procs)):
            stop_process(self.procs[name], timeout=30)


def http_json(url: str, body: dict | None = None, timeout: float = 120.0,
              headers: dict[str, str] | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def scrape(url: str) -> dict[str, float]:
    """Prometheus samples by name with labels (``name{a="b"}``), as text exposition gives them."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?)\s+(\S+)", line)
        if m and not line.startswith("#"):
            out[m.group(1)] = float(m.group(2))
    return out


def total(samples: dict[str, float], name: str, **labels: str) -> float:
    """Sum of ``name``'s samples whose labels include ``labels``."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for k, v in samples.items()
               if (k == name or k.startswith(name + "{")) and all(w in k for w in want))


def wait_for(predicate, timeout: float, what: str, procs: Procs, watch: list[str], interval: float = 1.0):
    """Poll ``predicate`` until it returns a truthy value; fail with the logs if a watched process exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name in watch:
            if procs.procs[name].poll() is not None:
                pytest.fail(f"{name} exited with {procs.procs[name].returncode} while waiting for {what}\n"
                            + procs.tails())
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}\n" + procs.tails())


async def canary(url: str) -> Canary:
    async with aiohttp.ClientSession(headers=ENGINE_AUTH) as session:
        return await send_canary(session, url, MODEL_NAME, 60, lambda: False)


@pytest.mark.parametrize("plane", ["nats", "no-broker"])
def test_real_vllm_engine_serves_through_the_fleet_and_its_kv_events_route_a_cache_hit(plane, request, tmp_path):
    python = vllm_python()
    model = write_tiny_model(tmp_path / "tiny-llama")
    adapter = write_adapter(python, tmp_path / ADAPTER)
    # a second adapter only vLLM's filesystem resolver knows of (loaded when a request first names it)
    resolvable = tmp_path / "resolver"
    shutil.copytree(adapter, resolvable / LATE)
    config = json.loads((resolvable / LATE / "adapter_config.json").read_text())
    (resolvable / LATE / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": str(model)}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("INFERA_", "VLLM_"))}
    env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
               DO_NOT_TRACK="1")
    procs = Procs(tmp_path, env)
    indexer_port, router_port, frontend_port, agent_port = (free_port() for _ in range(4))
    started = time.monotonic()
    try:
        if plane == "nats":
            common = ["--nats-url", request.getfixturevalue("nats_server"), "--log-format", "json"]
            procs.start("kv-indexer", [sys.executable, "-m", "infera_kv_indexer", *common,
                                       "--metrics-port", str(indexer_port)])
            procs.start("router", [sys.executable, "-m", "infera_router", *common, "--router-policy", "kv-aware",
                                   "--metrics-port", str(router_port)])
            procs.start("frontend", [sys.executable, "-m", "infera_frontend", *common, "--host", "127.0.0.1",
                                     "--port", str(frontend_port), "--model-path", str(model)])
            services = {"kv-indexer": indexer_port, "router": router_port, "frontend": frontend_port}
        else:  # the runbooks' plane: one server (frontend, router and index share its /metrics)
            common = ["--etcd-endpoint", request.getfixturevalue("etcd_server").endpoint, "--log-format", "json",
                      "--discovery-backend", "etcd", "--request-transport", "http", "--kv-event-transport", "zmq"]
            procs.start("server", [sys.executable, "-m", "infera.server", *common, "--host", "127.0.0.1",
                                   "--port", str(frontend_port), "--router-tokenizer-path", str(model),
                                   "--router-policy", "kv-aware"], env={**env, "INFERA_ENGINE_API_KEY": ENGINE_KEY})
            indexer_port = router_port = frontend_port
            services = {"server": frontend_port}
        engine_env = {
            **env,
            "VLLM_HOST_IP": "127.0.0.1",
            "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache: plenty for a 2-layer model
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true", "VLLM_LORA_RESOLVER_CACHE_DIR": str(resolvable),
        }
        procs.start("worker-agent", [
            sys.executable, "-m", "infera_worker_agent", *common, "--advertise-host", "127.0.0.1", "--engine", "vllm",
            "--engine-python", python, "--worker-id", WORKER_ID, "--metrics-port", str(agent_port),
            "--health-timeout", str(START_TIMEOUT), "--engine-stop-timeout", "15",
            "--",
            "--model", str(model), "--served-model-name", MODEL_NAME, ALIAS, "--api-key", ENGINE_KEY,
            "--load-format", "dummy",
            "--host", "127.0.0.1", "--block-size", str(BLOCK_SIZE), "--max-model-len", "1024",
            "--max-num-seqs", "8", "--enable-prefix-caching", "--enable-prompt-tokens-details",
            "--enable-lora", "--lora-modules", f"{ADAPTER}={adapter}", "--max-lora-rank", "8",
            *kv_cache_dtype_args(),
        ], env=engine_env)
        for name, port in services.items():
            wait_port("127.0.0.1", port, 30, procs.procs[name])
        frontend = f"http://127.0.0.1:{frontend_port}"

        def active_worker():
            status, body = http_json(frontend + "/v1/workers", timeout=5)
            rows = [w for w in body.get("data", []) if w.get("worker_id") == WORKER_ID]
            return rows[0] if rows and rows[0].get("status") == "active" else None

        worker = wait_for(active_worker, START_TIMEOUT + 30, "the vLLM worker to be active", procs,
                          ["worker-agent", *services])
        startup_s = time.monotonic() - started
        assert worker["model"] == MODEL_NAME
        assert worker.get("kv_block_size") == BLOCK_SIZE
        # its KV pool as vLLM reports it (vllm:cache_config_info): what the routers' eviction term divides by
        capacity = worker.get("kv_capacity_tokens")
        assert isinstance(capacity, int) and capacity >= 1024 and capacity % BLOCK_SIZE == 0, capacity
        print(f"vLLM worker active after {startup_s:.1f}s: {json.dumps(worker)}")
        # launched from vLLM 0.32's own server module, not the one it deprecates (whose warnings the
        # engine's output, echoed into the agent's log, would carry)
        agent_log = procs.log_path("worker-agent").read_text(errors="replace")
        assert '"vllm.entrypoints.launchers.api_server.entry"' in agent_log
        assert "api_server` is deprecated" not in agent_log and "DeprecationWarning" not in agent_log
        # the relay listens where the engine really publishes: vLLM's own report of its publishers
        # (0.32: a map {dp_rank: KVEventsConfig}; earlier: a list) names the registered port
        # the engine's --api-key: vLLM refuses a caller without it; its /v1/models lists both served
        # names without a parent, which the agent registered as the model and its alias
        assert worker["engine_api_key"] is True and worker["aliases"] == [ALIAS]
        assert http_json(worker["url"] + "/v1/models", timeout=10)[0] == 401
        status, listed = http_json(worker["url"] + "/v1/models", timeout=10, headers=ENGINE_AUTH)
        print("vLLM /v1/models:", json.dumps(listed))
        assert [(m["id"], m.get("parent")) for m in listed["data"]] == [
            (MODEL_NAME, None), (ALIAS, None), (ADAPTER, MODEL_NAME)]
        # the resolver's adapter, which vLLM does not list before its first request, is registered too
        assert worker["adapters"] == [ADAPTER, LATE] and worker["adapter_naming"] == "name"
        assert ENGINE_KEY not in procs.log_path("worker-agent").read_text(errors="replace")
        status, sources = http_json(worker["url"] + "/kv_event_sources", timeout=10, headers=ENGINE_AUTH)
        assert status == 200
        print("vLLM /kv_event_sources:", json.dumps(sources))
        reported = [item["endpoint"] for item in (sources.values() if isinstance(sources, dict) else sources)]
        assert [e.rsplit(":", 1)[1] for e in worker["kv_events_endpoints"]] == [e.rsplit(":", 1)[1] for e in reported]

        # 1. a chat completion through frontend -> router -> worker-agent -> vLLM (and by the alias)
        status, body = http_json(frontend + "/v1/chat/completions", {
            "model": ALIAS, "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 8, "temperature": 0, "ignore_eos": True,
        })
        assert status == 200, (body, procs.tails())
        print("answered by the alias as", body["model"])
        status, body = http_json(frontend + "/v1/chat/completions", {
            "model": MODEL_NAME, "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 8, "temperature": 0, "ignore_eos": True,
        })
        assert status == 200, (body, procs.tails())
        assert body["model"] == MODEL_NAME
        assert isinstance(body["choices"][0]["message"]["content"], str)
        assert body["usage"]["completion_tokens"] == 8
        # the token invariant: vLLM tokenized the chat exactly as the frontend's tokenizer does
        assert body["usage"]["prompt_tokens"] == chat_token_count(model, "Say hello.")
        assert total(scrape(frontend), "infera_frontend_token_mismatch_total") == 0

        # 2. a long prompt (several 32-token blocks), new to the cache: no hit on the first send
        router, indexer = f"http://127.0.0.1:{router_port}", f"http://127.0.0.1:{indexer_port}"
        prompt = {"model": MODEL_NAME, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "messages": [
            {"role": "user", "content": "Rivers carve canyons slowly. " * 12 + "Summarise the geology of erosion."}]}

        def hits() -> tuple[float, float]:
            s = scrape(router)
            return total(s, "infera_router_kv_hit_blocks_sum"), total(s, "infera_router_kv_hit_blocks_count")

        blocks_before = total(scrape(indexer), "infera_kv_indexer_worker_blocks", worker=WORKER_ID)
        before = hits()
        status, first = http_json(frontend + "/v1/chat/completions", prompt)
        assert status == 200, (first, procs.tails())
        after_first = hits()
        assert after_first[1] == before[1] + 1 and after_first[0] == before[0], "a new prompt is no cache hit"
        full_blocks = first["usage"]["prompt_tokens"] // BLOCK_SIZE
        assert full_blocks >= 3

        # vLLM's KV events (BlockStored) reach the kv-indexer through the agent's relay
        def indexed():
            s = scrape(indexer)
            return total(s, "infera_kv_indexer_worker_blocks", worker=WORKER_ID) - blocks_before >= full_blocks and s
        samples = wait_for(indexed, 30, "the kv-indexer to hold the prompt's blocks", procs, list(services)[:1], 0.2)
        assert total(samples, "infera_kv_indexer_blocks_applied_total", op="stored") >= full_blocks
        # real vLLM batches decode cleanly, and every stored block chains to a known parent, wherever
        # they are translated: by the worker-agent on the NATS plane, by the index itself on the ZMQ plane
        if plane == "nats":
            translator, metric = scrape(f"http://127.0.0.1:{agent_port}"), "infera_agent_kv_"
            assert total(translator, "infera_agent_kv_blocks_total", op="stored") >= full_blocks
        else:
            translator, metric = samples, "infera_kv_indexer_"
            assert total(samples, "infera_kv_indexer_events_applied_total") > 0
        assert total(translator, metric + "malformed_total") == 0
        assert total(translator, metric + "orphaned_blocks_total") == 0
        print("kv-indexer:", {k: v for k, v in samples.items() if "blocks_applied" in k or "worker_blocks" in k})
        # the worker counts as seen once its first events arrived (a gauge refreshed every second)
        wait_for(lambda: total(scrape(indexer), "infera_kv_indexer_workers", state="seen") == 1, 10,
                 "the kv-indexer to count the worker as seen", procs, list(services)[:1], 0.2)
        # the first request's lease is released: the router's own in-flight view no longer holds the
        # prompt, so a hit on the second send can only come from the kv-indexer
        wait_for(lambda: total(scrape(router), "infera_router_active_leases", worker=WORKER_ID) == 0, 30,
                 "the router to release the first request's lease", procs, list(services)[-1:], 0.2)

        # 3. the same prompt again: the router sees the cached prefix on the worker, vLLM serves it from cache
        status, second = http_json(frontend + "/v1/chat/completions", prompt)
        assert status == 200, (second, procs.tails())
        after_second = hits()
        hit_blocks = after_second[0] - after_first[0]
        assert after_second[1] == after_first[1] + 1
        assert hit_blocks >= full_blocks - 1, (hit_blocks, full_blocks)
        cached = (second["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
        assert cached is not None and cached >= BLOCK_SIZE, second["usage"]
        assert total(scrape(frontend), "infera_frontend_token_mismatch_total") == 0
        print(f"repeated prompt: {second['usage']['prompt_tokens']} tokens, {full_blocks} full blocks, "
              f"router hit {hit_blocks:.0f} blocks, vLLM cached_tokens {cached}; "
              f"total {time.monotonic() - started:.1f}s")

        # 4. what the worker-agent's stall check reads of a real vLLM: the token counters in its
        # /metrics, and its answer to the canary (a one-token completion)
        with urllib.request.urlopen(urllib.request.Request(worker["url"] + "/metrics", headers=ENGINE_AUTH),
                                    timeout=10) as r:
            load = parse_engine_metrics(r.read().decode())
        assert load is not None and load.tokens is not None and load.tokens > 0, load
        assert asyncio.run(canary(worker["url"])) is Canary.ANSWERED

        # 5. what the mock engine imitates, from the real one through the fleet: logprobs and a
        # completions batch with n samples (one choice per sample, each prompt counted once in
        # usage), with no token mismatch
        status, body = http_json(frontend + "/v1/chat/completions", {
            "model": MODEL_NAME, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 3,
            "temperature": 0, "ignore_eos": True, "logprobs": True, "top_logprobs": 2})
        assert status == 200, (body, procs.tails())
        content = body["choices"][0]["logprobs"]["content"]
        assert len(content) == 3 and all(set(e) >= {"token", "logprob", "bytes", "top_logprobs"} for e in content)
        assert all(len(e["top_logprobs"]) == 2 and e["logprob"] <= 0 for e in content), content
        prompts = ["The sky is", "Rivers flow to the"]
        status, body = http_json(frontend + "/v1/completions", {
            "model": MODEL_NAME, "prompt": prompts, "max_tokens": 2, "temperature": 0.5, "seed": 1, "n": 2,
            "ignore_eos": True})
        assert status == 200, (body, procs.tails())
        assert sorted(c["index"] for c in body["choices"]) == [0, 1, 2, 3]  # prompt x n + sample, as the mock
        assert body["usage"]["completion_tokens"] == 8
        tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
        assert body["usage"]["prompt_tokens"] == sum(len(tokenizer.encode(p).ids) for p in prompts), body["usage"]
        assert total(scrape(frontend), "infera_frontend_token_mismatch_total") == 0
        # and the stall check's idle canary, which a real vLLM answers as it answers any completion
        wait_for(lambda: total(scrape(f"http://127.0.0.1:{agent_port}"), "infera_agent_engine_canaries_total",
                               reason="idle", outcome="answered") >= 1, 40,
                 "the worker-agent's idle canary to be answered", procs, ["worker-agent"], 0.5)

        # 6. vLLM cuts max_tokens to what the prompt leaves of its context (1024) and refuses only
        # max_tokens past the context itself: the frontend lets the first through and refuses the second
        assert worker.get("clamps_max_tokens") is True and worker.get("context_length") == 1024
        words = 900
        while (n := chat_token_count(model, "erosion " * words)) > 1000:
            words -= 50
        long_chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "erosion " * words}],
                     "temperature": 0, "ignore_eos": True}
        status, body = http_json(frontend + "/v1/chat/completions", {**long_chat, "max_tokens": n})
        assert status == 200, (body, procs.tails())
        assert body["usage"]["completion_tokens"] == 1024 - n and body["choices"][0]["finish_reason"] == "length"
        status, body = http_json(frontend + "/v1/chat/completions", {**long_chat, "max_tokens": 1025})
        assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
        assert body["error"]["param"] == "max_tokens", body

        # 7. the LoRA adapter (--lora-modules): listed by the frontend with its base model; a prompt
        # it computed is found again through its own KV events (vLLM names the adapter in each
        # BlockStored); the same tokens asked of the base model are no hit (vLLM hashes the adapter
        # into every block, and Infera's index chains the adapter's blocks from its own root)
        status, models = http_json(frontend + "/v1/models", timeout=10)
        assert {m["id"]: m.get("parent") for m in models["data"]}[ADAPTER] == MODEL_NAME
        lora_prompt = {**prompt, "model": ADAPTER, "messages": [
            {"role": "user", "content": "Glaciers grind valleys wide. " * 12 + "Summarise the geology of ice."}]}
        status, first = http_json(frontend + "/v1/chat/completions", lora_prompt)
        assert status == 200 and first["model"] == ADAPTER, (first, procs.tails())
        lora_blocks = first["usage"]["prompt_tokens"] // BLOCK_SIZE
        wait_for(lambda: total(scrape(router), "infera_router_active_leases", worker=WORKER_ID) == 0, 30,
                 "the router to release the adapter request's lease", procs, list(services)[-1:], 0.2)
        time.sleep(1.5)  # (the relay and the index: a second is ample on this path, as above)
        before = hits()
        status, again = http_json(frontend + "/v1/chat/completions", lora_prompt)
        assert status == 200, (again, procs.tails())
        lora_hit = hits()[0] - before[0]
        assert lora_hit >= lora_blocks - 1, (lora_hit, lora_blocks)
        assert (again["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) >= BLOCK_SIZE
        before = hits()
        status, base = http_json(frontend + "/v1/chat/completions", {**lora_prompt, "model": MODEL_NAME})
        assert status == 200, (base, procs.tails())
        assert hits()[0] == before[0], "the base model holds none of the adapter's blocks"
        assert not (base["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
        assert total(scrape(frontend), "infera_frontend_token_mismatch_total") == 0
        print(f"LoRA: {lora_blocks} blocks, router hit {lora_hit:.0f} under the adapter, 0 for the base model")
        # 8. the resolver's adapter: routed here before vLLM lists it, and loaded by that request
        status, late = http_json(frontend + "/v1/chat/completions", {**lora_prompt, "model": LATE})
        assert status == 200 and late["model"] == LATE, (late, procs.tails())
        status, listed = http_json(worker["url"] + "/v1/models", timeout=10, headers=ENGINE_AUTH)
        assert (LATE, MODEL_NAME) in [(m["id"], m.get("parent")) for m in listed["data"]], listed
    finally:
        procs.stop_all()


#: vLLM's own parser run over launch lines: the parallel sizes it reads from each
PARSE_PARALLEL = """
import json, sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
sizes = []
for argv in json.loads(sys.argv[1]):
    a = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    sizes.append([a.tensor_parallel_size, a.pipeline_parallel_size, a.prefill_context_parallel_size,
                  a.data_parallel_size, a.data_parallel_size_local, a.data_parallel_rank])
print(json.dumps(sizes))
"""
GPU_LAUNCHES = [
    ["-tp", "8"],
    ["--tensor_parallel_size", "4", "--data-parallel-size", "2"],
    ["--data-parallel-size", "16", "--data-parallel-size-local", "8"],
    ["-dp", "8", "-dpn", "3", "-tp", "2"],
    ["-tp", "2", "-pcp", "2", "-pp", "2"],
]


def test_the_gpus_the_agent_counts_are_the_ones_vllm_parses():
    """The worker-agent refuses a launch that asks for more GPUs than the node shows (``engine_gpus``):
    its reading of the parallel flags (short forms, underscores) must be vLLM's."""
    out = subprocess.run([vllm_python(), "-c", PARSE_PARALLEL, json.dumps(GPU_LAUNCHES)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    for argv, (tp, pp, pcp, dp, dp_local, dp_rank) in zip(GPU_LAUNCHES, json.loads(out.stdout.splitlines()[-1])):
        ranks_here = 1 if dp_rank is not None else (dp_local if dp_local is not None else dp)
        assert gpus_needed("vllm", argv)[0] == tp * pp * pcp * ranks_here, argv


#: every option vLLM's own parser takes
LIST_FLAGS = """
import json
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
print(json.dumps([o for a in make_arg_parser(FlexibleArgumentParser())._actions for o in a.option_strings]))
"""


def test_no_vllm_flag_is_taken_for_a_mistyped_agent_flag():
    """The agent refuses an engine argument that looks like a mistyped agent flag (``infera_common.typos``):
    none of vLLM's own flags may look so."""
    from infera_common.typos import near_misses
    from infera_worker_agent.settings import agent_flags

    out = subprocess.run([vllm_python(), "-c", LIST_FLAGS], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    own = agent_flags()
    flags = [o for o in json.loads(out.stdout.splitlines()[-1]) if o.startswith("--") and o not in own]
    assert len(flags) > 300 and near_misses(flags, own) == []
