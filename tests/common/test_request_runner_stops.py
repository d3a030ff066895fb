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


async def test_the_work_in_flight_is_sized_per_router_as_each_router_counts_its_own():
    """What the agent's load report tells every router of the others' requests (``LoadReport.by_router_work``)."""

    async def publish(subject: str, data: bytes) -> None:
        pass

    class Streams:
        async def run(self, env, sink):
            if env.request_id == "decoding":
                await sink.send("head")
                await sink.send("data", body=b"{}")  # its first token went out
            await asyncio.sleep(10)
            return "ok"

    async def abort(request_id: str) -> None:
        pass

    runner = RequestRunner(publish, Counts(), vouch=lambda worker_id: False)
    engine = Engine(relay=Streams(), abort=abort)

    def env(request_id: str, router_id: str, stream: bool = True, **size) -> WorkEnvelope:
        return WorkEnvelope(request_id=request_id, endpoint=Endpoint.CHAT, body=b"{}", reply_subject="_INBOX.fe.1",
                            deadline=time.time() + 60, lease_id=request_id, router_id=router_id, stream=stream,
                            **size)

    await runner.submit("w1", env("decoding", "r1", prefill_tokens=100, decode_tokens=300), engine)
    await runner.submit("w1", env("prefilling", "r1", prefill_tokens=40, decode_tokens=50), engine)
    await runner.submit("w1", env("unary", "r1", stream=False, prefill_tokens=7, decode_tokens=9), engine)
    await runner.submit("w1", env("sized", "r2", prefill_tokens=5, decode_tokens=5), engine)
    await runner.submit("w1", env("unsized", "r2"), engine)  # from a router before the fields
    await runner.submit("w1", env("other", "r3", prefill_tokens=1, decode_tokens=2), engine)
    for _ in range(50):
        await asyncio.sleep(0.01)
        if runner.work_by_router()["r1"][1]:
            break
    assert runner.work_by_router() == {"r1": (40 + 7, 300), "r3": (1, 0)}  # r2: one of its requests unsized
    assert runner.in_flight_by_router() == {"r1": 3, "r2": 2, "r3": 1}
    await runner.close()
