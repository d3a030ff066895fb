"""How `infera up` stops its fleet: the front door first, then every worker together, then the
rest of the control plane, etcd and NATS last; each group's grace runs for all of it at once."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from infera.procs import stop_processes
from infera.up import DRAIN_GRACE, STOP_GRACE, _stop_order

#: A child that, on SIGTERM, notes the time, takes 0.5 s to finish, and notes its exit.
GRACEFUL = """
import signal, sys, time
out = open(sys.argv[1], "a")
def bye(*_):
    out.write(f"term {time.monotonic()}\\n"); out.flush()
    time.sleep(0.5)
    out.write(f"exit {time.monotonic()}\\n"); out.flush()
    sys.exit(0)
signal.signal(signal.SIGTERM, bye)
out.write("ready\\n"); out.flush()
while True:
    time.sleep(1)
"""
STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"


def test_the_frontend_goes_first_then_all_workers_then_the_rest():
    names = ["nats-server", "kv-indexer", "router", "frontend", "worker-1", "worker-2"]
    procs = {n: object() for n in names}
    order = _stop_order([(n, procs[n]) for n in names], {"worker-1", "worker-2"})
    assert [([names[list(procs.values()).index(p)] for p in group], grace) for group, grace in order] == [
        (["frontend"], DRAIN_GRACE), (["worker-1", "worker-2"], DRAIN_GRACE),
        (["kv-indexer", "router"], STOP_GRACE), (["nats-server"], STOP_GRACE)]
    # the no-broker plane: one infera.server is the front door
    server = object()
    assert _stop_order([("etcd", 1), ("server", server)], set())[0] == ([server], DRAIN_GRACE)


def test_a_group_is_told_to_stop_together_and_whoever_outlasts_the_grace_is_killed(tmp_path):
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    graceful = [subprocess.Popen([sys.executable, "-c", GRACEFUL, str(log)], start_new_session=True) for log in logs]
    stubborn = subprocess.Popen([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE, start_new_session=True,
                                text=True)
    try:
        assert stubborn.stdout.readline().strip() == "ready"
        for log in logs:
            while "ready" not in (log.read_text() if log.exists() else ""):
                time.sleep(0.01)
        stop_processes([*graceful, stubborn], timeout=3.0)
        assert [p.returncode for p in graceful] == [0, 0]
        assert stubborn.returncode == -signal.SIGKILL
        marks = [dict(line.split() for line in log.read_text().splitlines() if line != "ready") for log in logs]
        # both were told before either had finished: their grace periods ran side by side
        assert max(float(m["term"]) for m in marks) < min(float(m["exit"]) for m in marks)
    finally:
        for p in [*graceful, stubborn]:
            if p.poll() is None:
                p.kill()


def test_a_process_is_restarted_at_most_five_times_within_ten_minutes_and_again_after():
    """A crash a day is restarted every day; a process that fails at once stops the fleet quickly."""
    from infera.up import RESTART_WINDOW, RESTARTS, RestartBudget

    budget = RestartBudget(RESTARTS, RESTART_WINDOW)
    assert [budget.take("etcd", float(t)) for t in range(RESTARTS + 1)] == [True] * RESTARTS + [False]
    assert budget.take("router", 5.0)  # counted apart
    assert budget.take("etcd", RESTART_WINDOW + 0.5)  # the first restart left the window
    assert not budget.take("etcd", RESTART_WINDOW + 0.6)
    day = 86_400.0
    assert all(budget.take("server", n * day) for n in range(1, 20))
