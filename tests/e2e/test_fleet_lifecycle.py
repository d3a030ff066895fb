"""Workers coming and going, and `infera up` cleaning up after itself."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request

from infera_common.models import BUNDLED_MODEL_NAME
from tests.e2e.fleet import Fleet, descendants_alive, engine_pid, env_with, process_tree

CHAT = json.dumps({"model": BUNDLED_MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
                   "max_tokens": 4}).encode()


def _chat(url: str) -> int:
    req = urllib.request.Request(url + "/v1/chat/completions", data=CHAT, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code


def test_killed_engine_leaves_the_fleet_within_ttl_and_requests_keep_succeeding(tmp_path):
    ttl = 2.0
    fleet = Fleet(tmp_path, workers=2, extra=["--engine-arg=--speedup 20"],
                  env=env_with(INFERA_DISCOVERY_TTL=str(ttl))).start()
    try:
        workers = fleet.workers_list()
        assert len(workers) == 2
        victim = workers[0]
        os.kill(engine_pid(victim["url"]), signal.SIGKILL)
        t0 = time.monotonic()
        statuses = []
        while time.monotonic() - t0 < ttl + 3:
            ids = [w["worker_id"] for w in fleet.workers_list()]
            if victim["worker_id"] not in ids:
                break
            statuses.append(_chat(fleet.url))
        gone_after = time.monotonic() - t0
        assert victim["worker_id"] not in [w["worker_id"] for w in fleet.workers_list()]
        assert gone_after <= ttl + 1.0, gone_after
        # with one worker left, every request succeeds
        assert all(_chat(fleet.url) == 200 for _ in range(8))
        assert [w["worker_id"] for w in fleet.workers_list()] == [workers[1]["worker_id"]]
    finally:
        fleet.stop()


def test_infera_up_sigterm_stops_every_process_it_started(tmp_path):
    fleet = Fleet(tmp_path, workers=2, env=env_with()).start()
    tree = process_tree(fleet.proc.pid)
    # nats-server, router, frontend, 2 agents, 2 engines (+ any watchdogs) under `infera up`
    assert len(tree) >= 7, tree
    assert _chat(fleet.url) == 200
    assert fleet.stop() == 0
    deadline = time.monotonic() + 5
    while descendants_alive(tree) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert descendants_alive(tree) == []
