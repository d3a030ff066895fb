"""A fleet whose hosts' clocks disagree: each service process runs on its own wall clock (a
``sitecustomize`` shifts ``time.time`` in that process alone, as a host without time sync would)."""

from __future__ import annotations

import os
import time
import urllib.request

import pytest

from tests.e2e.manual_fleet import ManualFleet, active_workers, chat
from tests.e2e.runbook import wait_for

SHIFT = '''import os, time
_shift = float(os.environ.get("TEST_CLOCK_SHIFT_S", "0"))
if _shift:
    _time, _time_ns = time.time, time.time_ns
    time.time = lambda: _time() + _shift
    time.time_ns = lambda: _time_ns() + int(_shift * 1e9)
'''


def shifted(tmp_path, seconds: float) -> dict[str, str]:
    """The environment of a process whose wall clock runs ``seconds`` off this host's."""
    site = tmp_path / "clock-shift"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SHIFT)
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "TEST_CLOCK_SHIFT_S": str(seconds)}


def _metric(fleet: ManualFleet, service: str, name: str) -> float:
    spec = fleet.specs[service][0]
    port = spec.args[spec.args.index("--metrics-port") + 1]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} not in the {service}'s metrics")


def test_a_fleet_whose_clocks_disagree_by_more_than_a_ttl_serves_and_keeps_its_workers(tmp_path):
    """One worker's host 20 s behind the frontend's, the other 20 s ahead, the router's 8 s ahead
    (more than --route-timeout), the kv-indexer's 3 s behind. Before: the worker 20 s behind was
    dropped from every view right after each heartbeat (each looked 20 s old against a 3 s TTL),
    and the router refused every request as past its route deadline (504); until session 32 the
    kv-indexer counted the offset of a relaying worker's clock as the relay's lag."""
    fleet = ManualFleet(tmp_path)
    try:
        fleet.start(service_env={"worker-1": shifted(tmp_path, -20), "worker-2": shifted(tmp_path, 20),
                                 "router": shifted(tmp_path, 8), "kv-indexer": shifted(tmp_path, -3)})
        both = active_workers(fleet.url)
        assert len(both) == 2
        statuses = []
        prompt = "the same long question about clocks " * 40  # several KV blocks
        end = time.monotonic() + 8  # over two TTLs: heartbeats of both workers come and age
        while time.monotonic() < end:
            assert active_workers(fleet.url) == both
            statuses.append(chat(fleet.url, f"question {len(statuses)}")[0])
        assert statuses and set(statuses) == {200}
        first, again = chat(fleet.url, prompt), chat(fleet.url, prompt)
        assert first[0] == again[0] == 200
        assert again[1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # routed to its cache
        wait_for(lambda: abs(_metric(fleet, "router", "infera_router_requester_clock_offset_seconds") - 8) < 0.5,
                 10, "the router's measured offset to the frontend")
        assert _metric(fleet, "router", "infera_router_route_expired_total") == 0
        # the indexer reads the relays' times with each worker's offset: no relay is 20 s late
        relays = _metric(fleet, "kv-indexer", "infera_kv_indexer_lag_seconds_count")
        assert relays > 0 and _metric(fleet, "kv-indexer", 'infera_kv_indexer_lag_seconds_bucket{le="5.0"}') == relays
    except BaseException:
        print(fleet.logs())
        raise
    finally:
        fleet.stop()


@pytest.mark.parametrize("transport", ["nats", "http"])
def test_request_deadlines_are_read_on_the_frontends_clock_where_the_engine_is_called(tmp_path, transport):
    """The frontend gives each request 9 s (``--request-timeout`` 8, ``--route-timeout`` 5 plus
    ``--upstream-timeout`` 4: the larger of the two); the hosts that call the engines
    (the worker-agents on the NATS request plane, the router on ``--request-transport http``) run
    20 s ahead of it. Before: every request was refused there as past its deadline (504), the first
    of each frontend included; now each reads the deadline with its measured offset."""
    fleet = ManualFleet(tmp_path)
    ahead = shifted(tmp_path, 20)
    callers = ["router"] if transport == "http" else ["worker-1", "worker-2"]
    try:
        fleet.start(request_transport=transport, service_env={"frontend": {"INFERA_REQUEST_TIMEOUT": "8",
                                                                           "INFERA_UPSTREAM_TIMEOUT": "4"},
                                                              **{name: ahead for name in callers}})
        assert len(active_workers(fleet.url)) == 2
        statuses = [chat(fleet.url, f"question {i}")[0] for i in range(6)]
        assert statuses == [200] * 6
    except BaseException:
        print(fleet.logs())
        raise
    finally:
        fleet.stop()
