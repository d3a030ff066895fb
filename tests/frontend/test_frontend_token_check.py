"""The token invariant on answers: the engine's usage.prompt_tokens vs the frontend's own count."""

from __future__ import annotations

import json

import pytest

from infera_common.fleet import Change
from infera_common.schemas import Frame
from infera_frontend import relay as relay_module
from infera_frontend.token_check import TokenChecker, reported_prompt_tokens
from tests.frontend.frontend_fakes import (
    MODEL, WORKER, chat_body, chunk_json, completion_json, script_ok, worker_record,
)
from tests.frontend.test_frontend_http import post, sse_payloads


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []

    def warning(self, event: str, **kw) -> None:
        self.events.append((event, kw))

    def __getattr__(self, name):  # info/debug/error: ignored
        return lambda *a, **k: None


def body_with_usage(prompt_tokens: int) -> bytes:
    data = json.loads(completion_json())
    data["usage"]["prompt_tokens"] = prompt_tokens
    return json.dumps(data).encode()


def usage_chunk(prompt_tokens: int) -> bytes:
    return json.dumps({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
                       "choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 3,
                                                "total_tokens": prompt_tokens + 3}}).encode()


def engine_counting(prompt_tokens: int):
    async def script(fleet, req) -> None:
        if not req.stream:
            await fleet.frame(req, Frame(kind="head", status=200, body=body_with_usage(prompt_tokens), final=True))
            return
        await fleet.frame(req, Frame(kind="head", status=200))
        await fleet.frame(req, Frame(kind="data", seq=1, body=chunk_json(0, "Two")))
        await fleet.frame(req, Frame(kind="data", seq=2, body=usage_chunk(prompt_tokens)))
        await fleet.frame(req, Frame(kind="end", seq=3))
    return script


def mismatches(fe) -> float:
    return fe.metrics.registry.get_sample_value("infera_frontend_token_mismatch_total", {"worker": WORKER}) or 0.0


@pytest.fixture
def logged(monkeypatch) -> Recorder:
    rec = Recorder()
    monkeypatch.setattr(relay_module, "log", rec)
    return rec


async def test_usage_mismatch_is_counted_per_request_and_logged_once_per_worker(frontend, fleet, logged):
    fleet.script = engine_counting(36)  # the frontend counts 35 for "1+1=?"
    for _ in range(2):
        status, _, body = await post(frontend, "/v1/chat/completions", chat_body())
        assert status == 200 and json.loads(body)["usage"]["prompt_tokens"] == 36  # the answer is untouched
    status, _, raw = await post(frontend, "/v1/chat/completions",
                                chat_body(stream=True, stream_options={"include_usage": True}))
    assert status == 200 and sse_payloads(raw)[-1] == b"[DONE]"
    assert mismatches(frontend) == 3
    warnings = [kw for event, kw in logged.events if event == "token_mismatch"]
    assert len(warnings) == 1
    assert (warnings[0]["worker_id"], warnings[0]["frontend_prompt_tokens"], warnings[0]["engine_prompt_tokens"]) == (
        WORKER, 35, 36)


async def test_a_worker_that_leaves_takes_its_mismatch_series_along(frontend, fleet, logged):
    fleet.script = engine_counting(36)
    await post(frontend, "/v1/chat/completions", chat_body())
    assert mismatches(frontend) == 1
    frontend._on_change(Change("leave", worker_record()))  # what discovery says when it goes
    registry = frontend.metrics.registry
    assert registry.get_sample_value("infera_frontend_token_mismatch_total", {"worker": WORKER}) is None
    frontend._on_change(Change("join", worker_record()))  # back (a new engine): its first mismatch is logged again
    await post(frontend, "/v1/chat/completions", chat_body())
    assert mismatches(frontend) == 1 and len([e for e, _ in logged.events if e == "token_mismatch"]) == 2


async def test_matching_usage_and_answers_without_usage_count_nothing(frontend, fleet, logged):
    fleet.script = engine_counting(35)
    assert (await post(frontend, "/v1/chat/completions", chat_body()))[0] == 200
    assert (await post(frontend, "/v1/chat/completions", chat_body(stream=True)))[0] == 200
    # the request does not get include_usage added: the stream the fake router saw is the client's
    assert b"include_usage" not in fleet.routed[-1].body
    fleet.script = script_ok  # an engine stream without a usage chunk: nothing to check
    assert (await post(frontend, "/v1/chat/completions", chat_body(stream=True)))[0] == 200
    assert mismatches(frontend) == 0 and not logged.events


def test_reported_prompt_tokens_reads_usage_only():
    assert reported_prompt_tokens(body_with_usage(7)) == 7
    assert reported_prompt_tokens(usage_chunk(12)) == 12
    assert reported_prompt_tokens(chunk_json(0, "x")) is None
    assert reported_prompt_tokens(b'{"usage": {"prompt_tokens": "x"}}') is None
    assert reported_prompt_tokens(b'not json "prompt_tokens"') is None


def test_checker_reports_first_mismatch_per_worker():
    c = TokenChecker()
    assert c.mismatch("a", 5, 5) == (False, False)
    assert c.mismatch("a", 5, 6) == (True, True)
    assert c.mismatch("a", 5, 6) == (True, False)
    assert c.mismatch("b", 5, 6) == (True, True)
