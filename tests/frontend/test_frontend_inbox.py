"""The frontend's reply inbox on a real nats-server: what it tells the services that ask about it."""

from __future__ import annotations

import time

import nats.errors
import pytest

from infera_common.clock_offsets import read_time_answer
from infera_common.nats_conn import connect, flush_all
from infera_common.subjects import requester_alive_subject

from infera_frontend.inbox import Inbox


async def test_a_frontend_restarted_under_the_same_id_does_not_answer_for_its_predecessor(nats_server):
    """A worker-agent asks the frontend behind each running request whether it is there; a
    restarted frontend with a fixed --frontend-id used to say yes for requests its predecessor
    left, which then ran to their last token for nobody."""
    asker = await connect(nats_server, "agent")
    frontend = await connect(nats_server, "frontend")
    try:
        before = Inbox(frontend, "fe-fixed")
        await before.start()
        subject, _ = before.open()  # a request of the first start
        await before.stop()
        after = Inbox(frontend, "fe-fixed")  # the same id, started again
        await after.start()
        await flush_all(frontend)
        assert after.prefix != before.prefix and after.prefix.startswith("_INBOX.fe-fixed-")
        with pytest.raises(nats.errors.NoRespondersError):
            await asker.request(requester_alive_subject(subject), b"", timeout=1)
        answer = await asker.request(after.alive_subject, b"", timeout=1)  # the running one answers: its clock
        assert read_time_answer(answer.data) == pytest.approx(time.time(), abs=1)
        await after.stop()
    finally:
        await asker.close()
        await frontend.close()
