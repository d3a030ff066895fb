"""A client that reads a stream more slowly than its engine writes it: the frontend holds at most
``--max-unread-frames`` of it, cancels the engine's request past that, and writes a backlog in slices."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import aiohttp

from infera_common.frames import encode_frame
from infera_common.schemas import Endpoint, Frame
from infera_frontend.exchange import READ_BATCH, Exchange
from infera_frontend.inbox import Mailbox
from tests.frontend.frontend_fakes import MODEL, chat_body, chunk_json, url, wait_until
from tests.frontend.test_frontend_http import sse_payloads

FLOOD = 3000
FILLER = "x" * 4000  # ~4 KB a chunk: the client's and the kernel's buffers fill long before the end


async def flood(fleet, req) -> None:
    """An engine that writes FLOOD chunks as fast as it can, whoever reads them."""
    await fleet.frame(req, Frame(kind="head", status=200))
    for i in range(FLOOD):
        await fleet.frame(req, Frame(kind="data", seq=i + 1, body=chunk_json(i, FILLER)))
    await fleet.frame(req, Frame(kind="end", seq=FLOOD + 1))


async def test_a_client_that_stops_reading_has_its_request_cancelled_and_gets_what_waited_then_an_error(
        make_frontend, fleet):
    fe = await make_frontend(upstream_timeout=30, max_unread_frames=256)
    await wait_until(lambda: fe.models.is_known(MODEL))
    fleet.script = flood
    async with aiohttp.ClientSession() as s:
        resp = await s.post(url(fe, "/v1/chat/completions"), json=chat_body(stream=True))
        assert resp.status == 200
        await resp.content.readuntil(b"\n\n")  # the first chunk, then the client stops reading
        rid = resp.headers["X-Request-Id"]
        assert await fleet.wait_cancel(rid, timeout=10.0) is not None  # the engine stops, unread
        raw = await resp.read()  # the client reads again
        async with s.get(url(fe, "/metrics")) as r:
            metrics = await r.text()
    payloads = sse_payloads(raw)
    assert payloads[-1] == b"[DONE]"
    err = json.loads(payloads[-2])["error"]
    assert err["code"] == "client_too_slow" and "--max-unread-frames" in err["message"], err
    assert len(payloads) < FLOOD  # not the whole answer: what waited, then the error
    assert "infera_frontend_clients_too_slow_total 1.0" in metrics


async def test_a_client_that_never_reads_again_loses_its_connection_after_the_grace(make_frontend, fleet):
    """Else its handler would wait on the socket for good, holding what waited for it."""
    fe = await make_frontend(upstream_timeout=30, max_unread_frames=256)
    fe.http.slow_client_grace = 0.5
    await wait_until(lambda: fe.models.is_known(MODEL))
    fleet.script = flood
    async with aiohttp.ClientSession() as s:
        resp = await s.post(url(fe, "/v1/chat/completions"), json=chat_body(stream=True))
        await resp.content.readuntil(b"\n\n")  # then never reads again
        assert await fleet.wait_cancel(resp.headers["X-Request-Id"], timeout=10.0) is not None
        await wait_until(lambda: len(fe.inbox) == 0, timeout=5.0)  # the handler ended, its frames freed
        resp.close()


def test_a_mailbox_past_its_limit_drops_what_comes_and_says_so_once():
    box = Mailbox(asyncio.new_event_loop(), limit=3)
    overflows = []
    box.on_overflow = lambda: overflows.append(len(box))
    for i in range(6):
        box.put(i)
    box.force("end")  # the reader's end marker goes in all the same
    assert overflows == [3] and [box.get_nowait() for _ in range(len(box))] == [0, 1, 2, "end"]


async def test_a_backlog_is_returned_in_slices_so_the_event_loop_runs_between_its_writes():
    relay = SimpleNamespace(metrics=SimpleNamespace(), upstream_timeout=5.0)
    box = Mailbox(asyncio.get_running_loop())
    ex = Exchange(relay, "r1", "w1", "s", box, stream=True, endpoint=Endpoint.CHAT)
    for i in range(1000):
        box.put(SimpleNamespace(data=encode_frame("data", i, body=b'{"n": %d}' % i)))
    box.put(SimpleNamespace(data=encode_frame("end", 1000)))
    slices = []
    while payloads := await ex.read():
        slices.append(len(payloads))
    assert slices == [READ_BATCH] * 3 + [1000 - 3 * READ_BATCH] and ex.done
