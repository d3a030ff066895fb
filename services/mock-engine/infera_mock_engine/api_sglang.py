"""SGLang native endpoints: POST /generate and POST /abort_request.

/generate streams like SGLang's default (non-incremental) mode: every frame carries the text and
output ids generated so far, `meta_info.finish_reason` is null until the last frame.
"""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from infera_mock_engine.engine import GenerationFailed, GenerationParams, GenerationStream, Output, RequestError
from infera_mock_engine.http_common import (
    SseWriter, dumps, engine_of, json_response, parse_body, request_id, require_ready,
)
from infera_mock_engine.pd_request import routing
from infera_mock_engine.protocol import AbortRequest, GenerateRequest
from infera_mock_engine.sse_frames import CumulativeOutput


def finish_reason_object(out: Output, completion_tokens: int) -> dict[str, Any] | None:
    if out.finish_reason is None:
        return None
    if out.finish_reason == "length":
        return {"type": "length", "length": completion_tokens}
    if out.finish_reason == "stop":
        return {"type": "stop", "matched": out.matched_stop}
    return {"type": "abort", "message": out.message or "aborted"}


def _meta(stream: GenerationStream, out: Output, started: float) -> dict[str, Any]:
    return {
        "id": stream.params.rid,
        "finish_reason": finish_reason_object(out, stream.completion_tokens),
        "prompt_tokens": stream.prompt_tokens,
        "completion_tokens": stream.completion_tokens,
        "cached_tokens": stream.cached_tokens,
        "e2e_latency": time.monotonic() - started,
    }


def _single(value: Any, what: str) -> Any:
    if isinstance(value, list) and value and isinstance(value[0], (str, list)):
        if len(value) != 1:
            raise RequestError(f"batched {what} ({len(value)}) are not supported: send one prompt per request",
                               param=what)
        return value[0]
    return value


async def generate(request: web.Request) -> web.StreamResponse:
    engine = engine_of(request)
    require_ready(engine)
    body = await parse_body(request, GenerateRequest)
    if (body.text is None) == (body.input_ids is None):
        raise RequestError("give exactly one of `text` and `input_ids`", param="text")
    sp = body.sampling_params
    if sp.n != 1:
        raise RequestError(f"n={sp.n} is not supported: the mock engine returns one output per request",
                           param="sampling_params.n")
    if body.text is not None:
        prompt_ids = engine.tokenizer.encode(_single(body.text, "text"), add_special_tokens=True)
    else:
        prompt_ids = list(_single(body.input_ids, "input_ids"))
    rid = request_id(request, _single(body.rid, "rid"))
    params = GenerationParams(
        rid=rid,
        prompt_ids=prompt_ids,
        max_new_tokens=sp.max_new_tokens,
        stop=sp.stop_list(),
        stop_token_ids=list(sp.stop_token_ids or ()),
        temperature=sp.temperature,
        seed=sp.sampling_seed if sp.sampling_seed is not None else sp.seed,
        ignore_eos=sp.ignore_eos,
    )
    params.routing = routing(body, request.headers, engine.config.engine_flavor, engine.config.disagg)
    started = time.monotonic()
    stream = engine.submit(params)
    async with stream:
        if not body.stream:
            text, ids, last = await stream.collect()
            return json_response({"text": text, "output_ids": ids, "meta_info": _meta(stream, last, started)}, rid)
        sse = SseWriter(request, rid)
        so_far = CumulativeOutput()  # {"text", "output_ids"} so far, kept JSON-encoded
        try:
            await sse.start()
            async for out in stream:
                so_far.add(out.text, out.token_ids)
                await sse.send_json(so_far.frame(dumps(_meta(stream, out, started))))
            return await sse.done()
        except GenerationFailed as e:  # SGLang streams a scheduler abort as a last frame with its status
            meta = _meta(stream, Output("", [], stream.completion_tokens), started)
            meta["finish_reason"] = {"type": "abort", "message": e.message, "status_code": e.status}
            try:
                await sse.send_json(so_far.frame(dumps(meta)))
                return await sse.done()
            except ConnectionError:
                return sse.response
        except ConnectionError:
            return sse.response  # client gone: leaving `async with stream` aborts the sequence


async def abort_request(request: web.Request) -> web.Response:
    engine = engine_of(request)
    body = await parse_body(request, AbortRequest)
    if body.abort_all:
        engine.abort_all()
    elif body.rid:
        engine.abort(body.rid)
    return web.Response(status=200)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/generate", generate)
    app.router.add_put("/generate", generate)
    app.router.add_post("/abort_request", abort_request)
