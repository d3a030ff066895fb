"""A fleet discovering its workers in etcd: `infera up --discovery-backend etcd` starts a real etcd.

Requests and KV events still go over NATS (the supported mix of this build). Shown: the workers
listed with their roles and backend, a chat completion, a killed worker dropping out within its
lease TTL while requests keep succeeding, a third worker (started as the runbooks do, with
`python -m infera.engine.mock ... --discovery-backend etcd --etcd-endpoint ...`) joining, and a
worker registered on the other backend named in the error a client gets instead of a timeout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from infera.procs import free_port, stop_process
from infera_common.models import BUNDLED_MODEL_NAME
from tests.e2e.fleet import Fleet, env_with, process_tree
from tests.e2e.runbook import wait_for

TTL = 2.0  # --discovery-ttl: the etcd lease TTL of every worker


def _chat(url: str, model: str = BUNDLED_MODEL_NAME, timeout: float = 15) -> tuple[int, dict]:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


def _agent_pid(fleet: Fleet, worker_id: str) -> int:
    for pid in process_tree(fleet.proc.pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if "infera_worker_agent" in argv and worker_id in argv:
            return pid
    raise LookupError(worker_id)


def _start_worker(fleet: Fleet, worker_id: str, *plane: str, model: str = BUNDLED_MODEL_NAME) -> subprocess.Popen:
    """A worker started by hand, as the runbooks do: python -m infera.engine.mock with the plane flags."""
    log = open(fleet.state_dir / f"{worker_id}.log", "ab")
    return subprocess.Popen(
        [sys.executable, "-m", "infera.engine.mock", "--nats-url", fleet.nats_url, *plane, "--worker-id", worker_id,
         "--metrics-port", "0", "--served-model-name", model, "--speedup", "20"],
        stdout=log, stderr=subprocess.STDOUT, env=env_with(INFERA_DISCOVERY_TTL=str(TTL)), start_new_session=True,
    )


@pytest.fixture(scope="module")
def etcd_fleet(tmp_path_factory):
    etcd_port = free_port()
    f = Fleet(tmp_path_factory.mktemp("etcd-fleet"), workers=2,
              extra=["--discovery-backend", "etcd", "--etcd-port", str(etcd_port), "--engine-arg=--speedup 20"],
              env=env_with(INFERA_DISCOVERY_TTL=str(TTL), INFERA_UPSTREAM_TIMEOUT="2"))
    f.etcd_endpoint = f"127.0.0.1:{etcd_port}"
    f.start()
    yield f
    f.stop()


def test_workers_register_in_etcd_serve_leave_within_the_lease_ttl_and_join(etcd_fleet):
    fleet = etcd_fleet
    assert f"etcd {fleet.etcd_endpoint}" in fleet.banner
    listing = fleet.get_json("/v1/workers")
    workers = sorted(listing["data"], key=lambda w: w["worker_id"])
    assert [(w["worker_id"], w["role"], w["status"], w["discovery_backend"]) for w in workers] == [
        ("mock-1", "aggregated", "active", "etcd"), ("mock-2", "aggregated", "active", "etcd")]
    assert listing["discovery"] == {"discovery_backend": "etcd", "etcd_endpoint": fleet.etcd_endpoint,
                                    "where": f"etcd at {fleet.etcd_endpoint} (keys /infera/workers/<worker_id>)"}
    status, body = _chat(fleet.url)
    assert status == 200 and body["choices"][0]["message"]["content"]

    # a killed worker-agent cannot revoke its lease: etcd drops its key when the lease expires
    os.kill(_agent_pid(fleet, "mock-1"), signal.SIGKILL)
    t0 = time.monotonic()
    statuses = []
    while "mock-1" in [w["worker_id"] for w in fleet.workers_list()]:
        assert time.monotonic() - t0 < TTL + 2.0, "the killed worker is still listed after its lease TTL"
        statuses.append(_chat(fleet.url)[0])
    assert statuses and statuses == [200] * len(statuses)  # requests kept succeeding meanwhile (failover)
    assert all(_chat(fleet.url)[0] == 200 for _ in range(4))
    assert [w["worker_id"] for w in fleet.workers_list()] == ["mock-2"]

    # a third worker started by hand with the runbook's plane flags joins the fleet
    third = _start_worker(fleet, "mock-3", "--discovery-backend", "etcd", "--etcd-endpoint", fleet.etcd_endpoint)
    try:
        wait_for(lambda: any(w["worker_id"] == "mock-3" and w["status"] == "active" for w in fleet.workers_list()),
              20, "mock-3 active in /v1/workers")
        assert all(_chat(fleet.url)[0] == 200 for _ in range(4))
    finally:
        assert stop_process(third, timeout=20) == 0
    # a clean stop revokes the lease: gone at once, not after the TTL
    assert "mock-3" not in [w["worker_id"] for w in fleet.workers_list()]


def test_a_worker_registered_on_nats_discovery_is_named_not_waited_for(etcd_fleet):
    fleet = etcd_fleet
    stray = _start_worker(fleet, "stray-1", "--discovery-backend", "nats", model="only-on-nats")
    try:
        def refused():
            status, body = _chat(fleet.url, model="only-on-nats", timeout=5)
            return body["error"] if status == 503 and body["error"]["code"] == "discovery_mismatch" else None

        err = wait_for(refused, 20, "the discovery mismatch error")
        assert "stray-1" in err["message"] and "registered in nats" in err["message"]
        assert f"etcd at {fleet.etcd_endpoint}" in err["message"] and "--discovery-backend" in err["message"]
        listing = fleet.get_json("/v1/workers")
        assert [(u["worker_id"], u["discovery_backend"]) for u in listing["not_in_discovery"]] == [("stray-1", "nats")]
        assert "stray-1" not in [w["worker_id"] for w in listing["data"]]
    finally:
        stop_process(stray, timeout=20)
