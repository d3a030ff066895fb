"""A request stopped before its task first ran (a client's cancel right behind its envelope) is
finished like any other: error frame, ack, release, counted. Pure asyncio, no broker."""

from __future__ import annotations

import asyncio
import time

import pytest

from infera_common.request_runner import Engine, RequestRunner
from infera_common.frames import decode_frame
from infera_common.schemas import Cancel, Endpoint, WorkEnvelope, encode


class Counts:
    def __init__(self) -> None:
        self.outcomes: list[str] = []
        self.running: list[int] = []

    def finished(self, outcome: str) -> None:
        self.outcomes.append(outcome)

    def in_flight(self, count: int) -> None:
        self.running.append(count)

    def cancel_received(self) -> None:
        pass

    def bad_cancel(self) -> None:
        pass


@pytest.mark.parametrize("runs_first", [True, False], ids=["cancel-after-it-ran", "cancel-before-it-ran"])
async def test_a_request_cancelled_at_any_moment_is_acked_released_and_untracked(runs_first):
    sent: list[tuple[str, bytes]] = []
    engine_calls: list[str] = []

    async def publish(subject: str, data: bytes) -> None:
        sent.append((subject, data))

    class Slow:
        async def run(self, env, sink):
            engine_calls.append(env.request_id)
            await asyncio.sleep(10)
            return "ok"

    async def abort(request_id: str) -> None:
        pass

    acks: list[int] = []

    async def ack() -> None:
        acks.append(1)

    counts = Counts()
    runner = RequestRunner(publish, counts, vouch=lambda worker_id: False)
    env = WorkEnvelope(request_id="q1", endpoint=Endpoint.CHAT, body=b"{}", reply_subject="_INBOX.client.1",
                       deadline=time.time() + 60, lease_id="L1", router_id="r1")
    await runner.submit("w1", env, Engine(relay=Slow(), abort=abort), ack)
    if runs_first:
        await asyncio.sleep(0)  # its task starts, and waits on the engine
    runner.cancel("w1", encode(Cancel(request_id="q1", lease_id="L1")))
    assert await runner.wait_idle(5)
    assert runner.in_flight == 0 and acks == [1] and counts.outcomes == ["cancelled"]
    assert engine_calls == (["q1"] if runs_first else [])  # the engine never had it when stopped before
    frames = [decode_frame(data) for subject, data in sent if subject == "_INBOX.client.1"]
    assert [(f.kind, f.status) for f in frames] == [("error", 499)]
    assert [subject for subject, _ in sent if "release" in subject] != []
