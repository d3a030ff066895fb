"""A router measures the clock offset to a real frontend inbox on a real nats-server."""

from __future__ import annotations

import asyncio

import pytest

from infera_common.nats_conn import connect, flush_all

from infera_frontend.inbox import Inbox
from infera_common.requester_clocks import RequesterClocks


async def test_a_frontend_says_its_time_and_a_gone_or_older_one_gives_no_offset(nats_server):
    router = await connect(nats_server, "router")
    frontend = await connect(nats_server, "frontend")
    spawned = []
    largest = []
    try:
        inbox = Inbox(frontend, "fe-1")
        await inbox.start()

        async def older(msg) -> None:  # a frontend from before the question: answers, empty
            await msg.respond(b"")

        await frontend.subscribe("_INBOX.fe-old.alive", cb=older)
        await flush_all(frontend)
        clocks = RequesterClocks(router, spawned.append, largest.append)
        assert clocks.offset_for(inbox.open()[0]) is None  # not known yet: a question is due
        assert clocks.offset_for(inbox.open()[0]) is None and len(spawned) == 1  # (one question at a time)
        assert clocks.offset_for("infera.router.pd.r1.lease-1") is None  # not a frontend's subject: never asked
        offset = await spawned.pop()
        assert offset == pytest.approx(0.0, abs=0.05)  # one host, one clock
        assert clocks.offset_for(inbox.open()[0]) == offset and spawned == []
        assert largest == [pytest.approx(abs(offset))]

        clocks.offset_for("_INBOX.fe-old.1")
        assert await spawned.pop() is None and clocks.offset_for("_INBOX.fe-old.2") is None

        await inbox.stop()  # the frontend leaves the bus: forgotten, asked afresh next time
        await flush_all(frontend)
        assert await clocks.ask(inbox.alive_subject) is None
        assert clocks.offset_for(inbox.open()[0]) is None and len(spawned) == 1
        await spawned.pop()
    finally:
        for coro in spawned:
            coro.close()
        await router.close()
        await frontend.close()



async def test_the_first_question_to_a_frontend_is_there_to_wait_for_and_only_the_first(nats_server):
    agent = await connect(nats_server, "agent")
    frontend = await connect(nats_server, "frontend")
    spawned = []
    try:
        inbox = Inbox(frontend, "fe-2")
        await inbox.start()
        await flush_all(frontend)
        clocks = RequesterClocks(agent, lambda question: spawned.append(asyncio.ensure_future(question)))
        subject = inbox.open()[0]
        assert clocks.offset_for(subject) is None  # the first question goes out ...
        answer = clocks.waiting(subject)
        assert answer is not None and len(spawned) == 1
        first = await answer  # ... and its answer is what the first envelopes wait for
        assert first == pytest.approx(0.0, abs=0.05) and clocks.offset_for(subject) == first
        assert clocks.waiting(subject) is None and len(spawned) == 1  # known: nothing to wait for
        clocks.offset_for("_INBOX.fe-nobody.1")  # no such frontend: one question, one wait at most
        assert await clocks.waiting("_INBOX.fe-nobody.1") is None
        assert clocks.waiting("_INBOX.fe-nobody.2") is None  # never waited for again
        assert clocks.waiting("infera.router.pd.r1.lease-1") is None  # not a frontend's inbox
        await inbox.stop()
    finally:
        await agent.close()
        await frontend.close()
