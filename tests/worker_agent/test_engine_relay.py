"""One envelope relayed to an (in-process) engine and back as frames."""

import asyncio
import json
import time

import aiohttp
import pytest

from infera_common.schemas import Frame, WorkEnvelope, decode
from infera_common.engine_relay import FrameSink, Relay

from .fake_engine import FakeEngine


@pytest.fixture
async def engine():
    e = await FakeEngine().start()
    yield e
    await e.close()


@pytest.fixture
async def session():
    s = aiohttp.ClientSession()
    yield s
    await s.close()


def envelope(body: dict, *, stream: bool, deadline_in: float = 30.0, rid: str = "req-1") -> WorkEnvelope:
    return WorkEnvelope(
        request_id=rid, endpoint="/v1/chat/completions", body=json.dumps(body).encode(), stream=stream,
        reply_subject="_INBOX.test.1", deadline=time.time() + deadline_in, lease_id="lease-1", router_id="r1",
    )


async def relay(session, url, env):
    sent: list[tuple[str, Frame]] = []

    async def publish(subject, data):
        sent.append((subject, decode(Frame, data)))

    outcome = await Relay(session, url).run(env, FrameSink(publish, env.reply_subject))
    assert all(subject == env.reply_subject for subject, _ in sent)
    frames = [f for _, f in sent]
    assert [f.seq for f in frames] == list(range(len(frames)))
    return outcome, frames


async def test_stream_becomes_head_data_end(engine, session):
    env = envelope({"stream": True, "events": 3}, stream=True)
    outcome, frames = await relay(session, engine.url, env)
    assert outcome == "ok"
    assert [f.kind for f in frames] == ["head", "data", "data", "data", "end"]
    assert frames[0].status == 200 and not frames[0].final
    assert [json.loads(f.body) for f in frames[1:4]] == [{"i": 0}, {"i": 1}, {"i": 2}]
    got = engine.requests[0]
    assert got["body"] == env.body  # forwarded verbatim
    assert got["headers"]["x-request-id"] == "req-1"


async def test_non_streaming_answer_is_one_final_head_with_the_body(engine, session):
    outcome, frames = await relay(session, engine.url, envelope({"mode": "json"}, stream=False, rid="r-9"))
    assert outcome == "ok"
    assert [(f.kind, f.final) for f in frames] == [("head", True)]  # nothing follows it
    assert frames[0].status == 200 and json.loads(frames[0].body)["id"] == "r-9"


@pytest.mark.parametrize("status, outcome", [(400, "ok"), (503, "error")])
async def test_engine_error_on_a_stream_is_head_with_status_and_body(engine, session, status, outcome):
    got, frames = await relay(session, engine.url, envelope({"mode": "status", "status": status}, stream=True))
    assert got == outcome
    assert [(f.kind, f.final) for f in frames] == [("head", True)]
    assert frames[0].status == status and json.loads(frames[0].body)["error"]["message"] == "nope"


async def test_engine_dying_mid_stream_gives_an_error_frame_502(engine, session):
    outcome, frames = await relay(session, engine.url, envelope({"stream": True, "mode": "drop", "events": 2}, stream=True))
    assert outcome == "error"
    assert [f.kind for f in frames][0] == "head" and frames[-1].kind == "error"
    assert frames[-1].status == 502


async def test_unreachable_engine_gives_an_error_frame_502(session):
    from infera.procs import free_port

    outcome, frames = await relay(session, f"http://127.0.0.1:{free_port()}", envelope({}, stream=False))
    assert outcome == "error"
    assert [(f.kind, f.status) for f in frames] == [("error", 502)]


async def test_deadline_passing_mid_stream_is_expired_with_504(engine, session):
    env = envelope({"stream": True, "mode": "hang", "events": 1}, stream=True, deadline_in=0.5)
    outcome, frames = await relay(session, engine.url, env)
    assert outcome == "expired"
    assert [f.kind for f in frames] == ["head", "data", "error"] and frames[-1].status == 504
    for _ in range(50):  # the engine sees its client go away
        if engine.cancelled:
            break
        await asyncio.sleep(0.02)
    assert engine.cancelled == ["req-1"]


async def test_the_envelopes_trace_context_reaches_the_engine_unchanged_when_tracing_is_off(engine, session):
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    env = envelope({"stream": False}, stream=False)
    env.headers = {"traceparent": parent}
    outcome, _ = await relay(session, engine.url, env)
    assert outcome == "ok"
    assert engine.requests[0]["headers"]["traceparent"] == parent  # no spans here: the client's context passes
    await relay(session, engine.url, envelope({"stream": False}, stream=False, rid="req-2"))
    assert "traceparent" not in engine.requests[1]["headers"]  # none given, none invented


async def test_a_sink_keeps_its_last_frames_to_send_them_again():
    sent: list[tuple[str, bytes]] = []

    async def publish(subject: str, data: bytes) -> None:
        sent.append((subject, data))

    sink = FrameSink(publish, "inbox.1", keep=3)
    for i in range(5):
        await sink.send("data", body=str(i).encode())
    assert sink.kept_from(2) == [data for _, data in sent[2:]]  # the last three
    assert sink.kept_from(5) == [] and sink.kept_from(1) is None and sink.kept_from(6) is None
    await sink.resend(sink.kept_from(3))
    assert sent[5:] == sent[3:5]  # the same bytes to the same subject
    sink.forget_frames()
    assert sink.kept_from(4) is None and sink.seq == 5
    assert FrameSink(publish, "inbox.2").kept_from(0) is None  # keeps nothing unless asked


def test_an_answer_gets_back_the_name_the_fleet_serves_its_model_by():
    """SGLang answers with the ``<model>:<adapter>`` it was sent; the client named the adapter."""
    from infera_common.engine_relay import model_renamer

    assert model_renamer(None) is None
    rename = model_renamer(("smol:sql", "sql"))
    assert rename(b'{"id":"x","model":"smol:sql","choices":[]}') == b'{"id":"x","model":"sql","choices":[]}'
    assert rename(b'{"model": "smol:sql"}') == b'{"model": "sql"}'
    # text that merely says the name, inside a string, is left as it is
    quoted = json.dumps({"model": "smol:sql", "text": 'say "model":"smol:sql"'}, separators=(",", ":")).encode()
    assert json.loads(rename(quoted)) == {"model": "sql", "text": 'say "model":"smol:sql"'}
    assert rename(b'{"model":"smol:sqlx"}') == b'{"model":"smol:sqlx"}'
