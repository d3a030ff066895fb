"""Requests whose frontend left the bus are stopped (``requester_watch``), against a real nats-server:
a frontend that answers, one that predates the question (subscribed, silent) and one that is gone."""

from __future__ import annotations

import asyncio

import pytest

from infera_common import requester_watch as watch_module
from infera_common.nats_conn import connect, flush_all
from infera_common.request_runner import REQUESTER_GONE
from infera_common.requester_watch import RequesterWatch
from infera_common.subjects import requester_alive_subject

LIVE, OLD, DEAD = "_INBOX.fe-live.alive", "_INBOX.fe-old.alive", "_INBOX.fe-dead.alive"


class Runner:
    """The two calls the watch makes of a ``RequestRunner``."""

    def __init__(self, subjects: set[str]) -> None:
        self.subjects = subjects
        self.stopped: list[tuple[str, object]] = []

    def requesters(self) -> set[str]:
        return set(self.subjects)

    def stop_requester(self, subject: str, reason) -> int:
        self.stopped.append((subject, reason))
        self.subjects.discard(subject)
        return 2


@pytest.fixture(autouse=True)
def quick(monkeypatch):
    monkeypatch.setattr(watch_module, "ASK_TIMEOUT", 0.2)


def test_the_subject_asked_is_the_frontends_own_and_none_for_a_router():
    assert requester_alive_subject("_INBOX.fe-1.17") == "_INBOX.fe-1.alive"
    assert requester_alive_subject("infera.router.pd.r1.lease-4") is None
    assert requester_alive_subject("_INBOX.abcdef") is None  # a client library's own inbox


async def test_only_the_requests_of_a_frontend_gone_for_the_whole_grace_are_stopped(nats_server, monkeypatch):
    monkeypatch.setattr(watch_module, "GONE_AFTER", 0.3)
    nc = await connect(nats_server, "agent")
    frontend = await connect(nats_server, "frontends")
    try:
        await frontend.subscribe("_INBOX.fe-live.*", cb=answer)
        await frontend.subscribe("_INBOX.fe-old.*", cb=ignore)  # an older frontend: takes it, says nothing
        await flush_all(frontend)
        runner = Runner({LIVE, OLD, DEAD})
        watch = RequesterWatch(nc, runner)
        assert await watch.check() == 0  # the dead one is absent since now: not yet gone
        await asyncio.sleep(0.35)
        assert await watch.check() == 2
        assert runner.stopped == [(DEAD, REQUESTER_GONE)]
        assert await watch.check() == 0 and runner.subjects == {LIVE, OLD}
    finally:
        await nc.close()
        await frontend.close()


async def test_a_frontend_back_on_the_bus_within_the_grace_keeps_its_requests(nats_server, monkeypatch):
    monkeypatch.setattr(watch_module, "GONE_AFTER", 0.3)
    nc = await connect(nats_server, "agent")
    frontend = await connect(nats_server, "frontend")
    try:
        runner = Runner({DEAD})
        watch = RequesterWatch(nc, runner)
        assert await watch.check() == 0  # away (reconnecting, say)
        await frontend.subscribe("_INBOX.fe-dead.*", cb=answer)
        await flush_all(frontend)
        await asyncio.sleep(0.35)
        assert await watch.check() == 0 and runner.stopped == []
    finally:
        await nc.close()
        await frontend.close()


async def answer(msg) -> None:
    await msg.respond(b"")


async def ignore(msg) -> None:
    pass
