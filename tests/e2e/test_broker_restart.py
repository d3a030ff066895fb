"""A fleet outliving its nats-server: killed and started again on the same port, with its store
directory (a process restart) or without (a new broker: every stream and bucket gone)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.request

import aiohttp
import nats
import pytest

from infera_common.models import BUNDLED_MODEL_NAME
from infera_common.subjects import KV_EVENT_STREAM
from tests.e2e.manual_fleet import ManualFleet, active_workers, chat
from tests.e2e.runbook import wait_for


@pytest.mark.parametrize("store", ["store", "fresh-store"], ids=["same-store", "new-broker"])
def test_the_fleet_serves_and_routes_by_cache_again_after_nats_server_restarts(tmp_path, store):
    fleet = ManualFleet(tmp_path).start()
    try:
        assert chat(fleet.url)[0] == 200
        workers = active_workers(fleet.url)
        os.kill(fleet.nats.pid, signal.SIGKILL)
        fleet.nats.wait()
        fleet.start_nats(store)
        # every service restores what the broker lost: queues, consumers, the discovery bucket,
        # the KV event stream and the watches on them
        wait_for(lambda: chat(fleet.url)[0] == 200, 20, "a request answered after the restart")
        wait_for(lambda: active_workers(fleet.url) == workers, 10, "both workers listed again")
        # KV-aware routing follows the engines' events again: a repeated long prompt lands where it is cached
        for i in range(3):
            prompt = " ".join(f"w{i}x{j}" for j in range(300))
            first, again = chat(fleet.url, prompt)[1], chat(fleet.url, prompt)[1]
            assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 1024, fleet.logs()
        assert all(p.poll() is None for p in fleet.procs), fleet.logs()  # nobody died of it
    finally:
        fleet.stop()


async def _answer(session: aiohttp.ClientSession, url: str, i: int, stream: bool) -> dict:
    """One request of 300 tokens: what its client got (text chunks, usage, the error event if any)."""
    body = {"model": BUNDLED_MODEL_NAME, "max_tokens": 300, "ignore_eos": True, "stream": stream,
            "messages": [{"role": "user", "content": f"tell me story {i}"}]}
    if stream:
        body["stream_options"] = {"include_usage": True}
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        if not stream:
            return {"status": resp.status, "body": await resp.json()}
        got: dict = {"status": resp.status, "chunks": 0, "usage": None, "error": None, "done": False}
        async for line in resp.content:
            if not line.startswith(b"data: "):
                continue
            payload = line[6:].strip()
            if payload == b"[DONE]":
                got["done"] = True
                continue
            event = json.loads(payload)
            if "error" in event:
                got["error"] = event["error"]["message"]
            elif event.get("usage"):
                got["usage"] = event["usage"]["completion_tokens"]
            if event.get("choices") and "role" not in event["choices"][0]["delta"]:  # one per token
                got["chunks"] += 1
        return got


def _frontend_metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return 0.0


@pytest.mark.parametrize("transport", ["nats", "http"])
def test_answers_in_flight_across_a_broker_restart_arrive_whole(tmp_path, transport):
    """Frames published while the broker is down never arrive, and a restarted broker has lost the
    queues: the frontend finds the gaps (frame numbers; each worker's count after its reconnect)
    and has the frames sent again, so every client gets its whole answer, and none waits for the
    upstream timeout (120 s here; the client gives up at 40 s)."""
    # records outlive the outage (with a TTL shorter than it, routers drop the workers and tell
    # their requesters so)
    fleet = ManualFleet(tmp_path).start(transport, INFERA_UPSTREAM_TIMEOUT="120", INFERA_DISCOVERY_TTL="10")

    async def run() -> list[dict]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=40)) as session:
            answers = [asyncio.create_task(_answer(session, fleet.url, i, stream=i % 3 != 0)) for i in range(9)]
            await asyncio.sleep(0.5)
            # the frontend comes back last, so the frames the agents held while the broker was down
            # reach a broker where nobody listens for them yet: lost, every time
            os.kill(fleet.frontend.pid, signal.SIGSTOP)
            os.kill(fleet.nats.pid, signal.SIGKILL)  # the answers (about 2 s each) end while it is down
            await asyncio.to_thread(fleet.nats.wait)
            await asyncio.sleep(2.5)
            fleet.start_nats("store")
            await asyncio.sleep(1.0)
            os.kill(fleet.frontend.pid, signal.SIGCONT)
            return await asyncio.gather(*answers)

    try:
        answers = asyncio.run(run())
        for got in answers:
            if "body" in got:  # not streamed
                assert got["status"] == 200 and got["body"]["usage"]["completion_tokens"] == 300, got
            else:
                assert got["status"] == 200 and got["done"] and got["error"] is None, got
                assert got["chunks"] == got["usage"] == 300, got  # every token, once
        assert _frontend_metric(fleet.url, "infera_frontend_frames_replayed_total") >= 1  # the outage did cost frames
        assert _frontend_metric(fleet.url, "infera_frontend_frames_lost_total") == 0
        assert all(p.poll() is None for p in fleet.procs), fleet.logs()
    finally:
        fleet.stop()


def test_prompts_cached_before_an_outage_longer_than_the_discovery_ttl_still_find_their_cache(tmp_path):
    """Every watcher ages the workers out while the broker is gone (TTL 3 s, outage 8 s) and lists them
    again after: their engines kept their caches, and blocks stored before the outage are never
    announced again. The index kept them (it dropped them, and those prompts went anywhere)."""
    fleet = ManualFleet(tmp_path).start()
    try:
        prompts = [" ".join(f"o{i}x{j}" for j in range(300)) for i in range(6)]
        for prompt in prompts:
            assert chat(fleet.url, prompt)[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        workers = active_workers(fleet.url)
        os.kill(fleet.nats.pid, signal.SIGKILL)
        fleet.nats.wait()
        time.sleep(8)
        fleet.start_nats("store")
        wait_for(lambda: chat(fleet.url)[0] == 200, 20, "a request answered after the restart")
        wait_for(lambda: active_workers(fleet.url) == workers, 10, "both workers listed again")
        cached = [chat(fleet.url, prompt)[1]["usage"]["prompt_tokens_details"]["cached_tokens"] for prompt in prompts]
        assert all(c >= 1024 for c in cached), (cached, fleet.logs())
    finally:
        fleet.stop()


def test_a_kv_indexer_restarted_after_the_events_left_the_stream_knows_the_cached_prompts_again(tmp_path):
    """The stream keeps --kv-event-max-age (1 h) of events, and a broker restarted without its store
    none: blocks cached for longer are in no event a restarted kv-indexer can replay (the stream is
    purged here). It asks the worker-agents for their whole holding, and routes those prompts to
    their cache again (it had them at depth 0, and sent them anywhere)."""
    fleet = ManualFleet(tmp_path).start()
    try:
        prompts = [" ".join(f"s{i}x{j}" for j in range(300)) for i in range(6)]
        for prompt in prompts:
            assert chat(fleet.url, prompt)[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        time.sleep(0.5)  # their KV events reached the stream
        asyncio.run(_purge_kv_events(f"nats://127.0.0.1:{fleet.nats_port}"))
        fleet.restart("kv-indexer")
        indexer_log = tmp_path / "logs" / "kv-indexer.log"
        wait_for(lambda: indexer_log.read_text().count("kv_indexer_serving") == 2, 30, "the indexer serving again")
        time.sleep(1.0)  # the agents' state relays came in
        cached = [chat(fleet.url, prompt)[1]["usage"]["prompt_tokens_details"]["cached_tokens"] for prompt in prompts]
        assert all(c >= 1024 for c in cached), (cached, fleet.logs())
    finally:
        fleet.stop()



async def _purge_kv_events(url: str) -> None:
    nc = await nats.connect(url)
    try:
        await nc.jetstream().purge_stream(KV_EVENT_STREAM)
    finally:
        await nc.close()
