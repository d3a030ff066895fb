"""What a service redoes after its NATS connection comes back (``nats_conn.Reconnects``), without a broker."""

from __future__ import annotations

import asyncio

from infera_common import nats_conn
from infera_common.nats_conn import Reconnects, RepeatedErrors


async def test_steps_run_in_order_and_a_failing_step_is_retried_until_it_succeeds(monkeypatch):
    monkeypatch.setattr(nats_conn, "RESTORE_RETRY", 0.001)
    calls: list[str] = []
    failures = iter([RuntimeError("JetStream not ready"), RuntimeError("still not"), None])

    async def queue():
        calls.append("queue")
        if (exc := next(failures)) is not None:
            raise exc

    async def record():
        calls.append("record")

    r = Reconnects()
    r.add("queue", queue)
    r.add("record", record)
    r.reconnected()
    for _ in range(200):
        if "record" in calls:
            break
        await asyncio.sleep(0.005)
    assert calls == ["queue", "queue", "queue", "record"]  # the record only once its queue exists
    await r.close()


async def test_a_reconnect_during_a_run_runs_the_steps_once_more_after_it(monkeypatch):
    runs: list[int] = []
    gate = asyncio.Event()

    async def step():
        runs.append(len(runs))
        if len(runs) == 1:
            await gate.wait()

    r = Reconnects()
    r.add("step", step)
    r.reconnected()
    await asyncio.sleep(0.01)
    r.reconnected()  # the broker went away and came back while the first run was still going
    r.reconnected()
    gate.set()
    for _ in range(200):
        if len(runs) == 2:
            break
        await asyncio.sleep(0.005)
    await asyncio.sleep(0.02)
    assert runs == [0, 1]  # not cancelled half-way, and two reconnects meanwhile ask for one more run
    await r.close()


async def test_a_step_that_never_succeeds_is_given_up_and_logged_and_the_next_steps_still_run(monkeypatch):
    monkeypatch.setattr(nats_conn, "RESTORE_RETRY", 0.0)
    monkeypatch.setattr(nats_conn, "RESTORE_ATTEMPTS", 3)
    calls: list[str] = []

    async def broken():
        calls.append("broken")
        raise RuntimeError("no")

    async def fine():
        calls.append("fine")

    r = Reconnects()
    r.add("broken", broken)
    r.add("fine", fine)
    await r.run()
    assert calls == ["broken"] * 3 + ["fine"]


def test_a_repeating_nats_error_is_logged_once_then_once_per_period_with_the_count_held_back():
    """An agent cut off from the broker heard "Connection refused" every 0.5 s, each one a log line."""
    repeats = RepeatedErrors(every=30.0)
    said = [(t, repeats.let_through("[Errno 111] Connection refused", t)) for t in (0.0, 0.5, 1.0, 29.5, 30.0, 31.0)]
    assert said == [(0.0, 0), (0.5, None), (1.0, None), (29.5, None), (30.0, 3), (31.0, None)]
    assert repeats.let_through("another error", 31.0) == 0  # each error on its own
    repeats.clear()  # reconnected: the next outage is told from its first error
    assert repeats.let_through("[Errno 111] Connection refused", 32.0) == 0


async def test_closing_the_client_is_not_logged_as_a_disconnect(nats_server, capsys):
    nc = await nats_conn.connect(nats_server, "closing-test")
    await nc.close()
    logged = capsys.readouterr()
    assert "nats_closed" in logged.out + logged.err and "nats_disconnected" not in logged.out + logged.err
