"""The runbook sequence, verbatim, on the no-broker plane: real etcd, ``python -m infera.server`` and
``python -m infera.engine.mock`` workers started by hand with the runbooks' flags, no NATS server anywhere.

Shown: /health; both workers listed with their roles and planes; a chat completion; a repeated long
prompt served from the cache of the worker that holds it (the engines' ZMQ events read by the server's
index); a killed worker dropping out of /v1/workers when its etcd lease expires while requests keep
succeeding; a third worker joining; and the server's log never mentioning a NATS connection.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from infera.procs import free_port, stop_process
from tests.e2e.runbook import Runbook, wait_for

TTL = "2"  # INFERA_DISCOVERY_TTL: the workers' etcd lease TTL (the runbook flags stay verbatim)
LONG_PROMPT = " ".join(f"word{i}" for i in range(400))


@pytest.fixture
def runbook(etcd_server, tmp_path):
    rb = Runbook(tmp_path, etcd_server.endpoint, env={"INFERA_DISCOVERY_TTL": TTL, "INFERA_LOG_FORMAT": "console"})
    yield rb
    rb.close()


def test_runbook_sequence_on_the_no_broker_plane(runbook):
    rb = runbook
    rb.start_server()
    assert rb.get("/health")[0] == 200
    rb.start_worker("w1", "--speedup", "20")
    rb.start_worker("w2", "--speedup", "20")
    def two_active() -> list[dict] | None:
        listed = rb.workers_listed()
        return listed if len([w for w in listed if w["status"] == "active"]) == 2 else None

    listed = wait_for(two_active, 90, "two active workers")
    assert {w["role"] for w in listed} == {"aggregated"}
    assert {(w["request_transport"], w["kv_event_transport"], w["discovery_backend"]) for w in listed} == {
        ("http", "zmq", "etcd")}

    status, body = rb.chat()
    assert status == 200 and body["choices"][0]["message"]["content"]

    # the same long prompt again: routed to the worker whose engine cached it (seen through its ZMQ events)
    status, first = rb.chat(LONG_PROMPT)
    assert status == 200
    prompt_tokens = first["usage"]["prompt_tokens"]

    def cached() -> int:
        s, again = rb.chat(LONG_PROMPT)
        assert s == 200
        return (again["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)

    assert wait_for(lambda: all(cached() >= prompt_tokens // 64 * 64 - 64 for _ in range(4)), 30,
                    "repeated prompt served from cache")

    # a crashed worker: requests keep succeeding while its lease runs out, then it is gone from the list
    errors: list[tuple[int, dict]] = []
    stop = threading.Event()

    def keep_asking() -> None:
        while not stop.is_set():
            s, b = rb.chat("still there?")
            if s != 200:
                errors.append((s, b))

    asker = threading.Thread(target=keep_asking)
    asker.start()
    try:
        rb.kill_worker("w1")
        wait_for(lambda: len(rb.workers_listed()) == 1, 30, "the killed worker dropping out")
        rb.start_worker("w3", "--speedup", "20")
        wait_for(lambda: len([w for w in rb.workers_listed() if w["status"] == "active"]) == 2, 90,
                 "a third worker joining")
    finally:
        stop.set()
        asker.join(60)
    assert errors == []
    assert all(rb.chat()[0] == 200 for _ in range(6))
    server_log = rb.log("server")
    assert not [w for w in ("nats://", "nats_error", "nats_disconnected", "nats_unreachable") if w in server_log]


def test_etcd_restart_the_fleet_re_registers_and_the_server_sees_every_change(runbook, etcd_server):
    """etcd goes away while the fleet runs: requests keep being served from the last view; a worker that
    dies during the outage is dropped once etcd is back (its lease is not renewed), the survivor stays,
    and a worker started afterwards joins."""
    rb = runbook
    rb.start_server()
    rb.start_worker("w1", "--speedup", "20")
    rb.start_worker("w2", "--speedup", "20")
    wait_for(lambda: len([w for w in rb.workers_listed() if w["status"] == "active"]) == 2, 90, "two workers")

    etcd_server.stop()
    assert rb.chat()[0] == 200  # the server routes on its last view while etcd is down
    rb.kill_worker("w2")
    etcd_server.start()

    wait_for(lambda: [w["status"] for w in rb.workers_listed()] == ["active"], 60,
             "the view after etcd came back: the survivor only")
    assert all(rb.chat()[0] == 200 for _ in range(4))
    rb.start_worker("w3", "--speedup", "20")
    wait_for(lambda: len([w for w in rb.workers_listed() if w["status"] == "active"]) == 2, 90, "w3 joining")
    assert rb.workers["w1"].poll() is None  # the survivor's agent rode out the outage


def test_a_worker_on_the_nats_request_plane_is_named_not_waited_for(runbook, nats_server):
    """A worker registered in the server's etcd but taking requests from a NATS queue (the runbook's
    transport flags left out): the server lists it, and a request gets 503 at once naming the flag."""
    rb = runbook
    rb.start_server()
    rb.planes = ["--discovery-backend", "etcd"]  # the transports at their NATS defaults
    rb.start_worker("w-nats", "--nats-url", nats_server, "--speedup", "20")
    wait_for(lambda: [w["status"] for w in rb.workers_listed()] == ["active"], 90, "the NATS-plane worker listed")
    assert rb.workers_listed()[0]["request_transport"] == "nats"
    status, body = rb.chat()
    assert status == 503
    message = body["error"]["message"]
    assert "--request-transport nats" in message and "--request-transport http" in message
    assert "worker_plane_mismatch" in rb.log("server")


def test_a_restarted_server_knows_the_prompts_cached_before_the_engines_replay_buffers(runbook):
    """The server's index reads the engines' own publishers, whose replay keeps only the last
    `buffer_steps` batches (3 here, 10,000 by default: minutes of serving): after a restart, prompts
    cached before them went unknown, and kv-aware sent them anywhere. The index now reads each
    worker-agent's state of its engine (its `kv_state_url`) first."""
    rb = runbook
    rb.start_server()
    for name in ("w1", "w2"):
        config = {"publisher": "zmq", "enable_kv_cache_events": True, "buffer_steps": 3,
                  "endpoint": f"tcp://*:{free_port()}", "replay_endpoint": f"tcp://*:{free_port()}"}
        rb.start_worker(name, "--speedup", "20", "--kv-events-config", json.dumps(config))
    wait_for(lambda: len([w for w in rb.workers_listed() if w["status"] == "active"]) == 2, 90, "two active workers")
    prompts = [" ".join(f"p{i}w{j}" for j in range(300)) for i in range(6)]
    for prompt in prompts:
        assert rb.chat(prompt)[0] == 200
    time.sleep(0.5)  # the last events reached the agents
    stop_process(rb.server, timeout=20)
    rb.start_server()
    wait_for(lambda: len([w for w in rb.workers_listed() if w["status"] == "active"]) == 2, 30, "both workers again")
    wait_for(lambda: rb.log("server").count("kv_state_read") >= 2, 30, "the agents' states read")
    cached = []
    for prompt in prompts:
        status, body = rb.chat(prompt)
        assert status == 200
        cached.append((body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    assert all(c >= 1024 for c in cached), (cached, rb.log("server")[-3000:])
