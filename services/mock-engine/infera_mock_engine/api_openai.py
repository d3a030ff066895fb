"""OpenAI-compatible endpoints as SGLang and vLLM serve them: /v1/chat/completions, /v1/completions.

Streaming is framed `data: {json}\\n\\n` ... `data: [DONE]\\n\\n`; the first chat chunk carries the
role; with stream_options.include_usage a last chunk with empty choices carries the usage.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from infera_mock_engine.engine import Engine, GenerationFailed, GenerationParams, GenerationStream, Output, RequestError
from infera_mock_engine.errors import stream_error_event
from infera_mock_engine.http_common import (
    SseWriter, dumps, engine_of, json_response, parse_body, request_id, require_ready,
)
from infera_mock_engine.pd_request import routing
from infera_mock_engine.protocol import ChatCompletionRequest, CompletionRequest, _OpenAIRequest
from infera_mock_engine.sse_frames import TEXT_SLOT, TextSplice


@dataclass(frozen=True)
class _Shape:
    chat: bool

    @property
    def id_prefix(self) -> str:
        return "chatcmpl-" if self.chat else "cmpl-"

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    @property
    def full_object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def delta_choice(self, text: str | None, finish_reason: str | None, role: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}


CHAT, COMPLETION = _Shape(chat=True), _Shape(chat=False)


def _check_common(engine: Engine, body: _OpenAIRequest) -> None:
    if body.n != 1:
        raise RequestError(f"n={body.n} is not supported: the mock engine returns exactly one choice (n=1)",
                           param="n")
    if engine.config.engine_flavor == "vllm" and body.model and body.model not in engine.config.served_model_names:
        raise RequestError(f"The model `{body.model}` does not exist.", status=404, param="model")


def _params(rid: str, prompt_ids: list[int], body: _OpenAIRequest, limit: int | None) -> GenerationParams:
    return GenerationParams(
        rid=rid,
        prompt_ids=prompt_ids,
        max_new_tokens=limit,
        stop=body.stop_list(),
        stop_token_ids=list(body.stop_token_ids or ()),
        temperature=1.0 if body.temperature is None else body.temperature,
        seed=body.seed,
        ignore_eos=body.ignore_eos,
    )


def _usage(stream: GenerationStream) -> dict[str, Any]:
    return {
        "prompt_tokens": stream.prompt_tokens,
        "completion_tokens": stream.completion_tokens,
        "total_tokens": stream.prompt_tokens + stream.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": stream.cached_tokens},
    }


def _stop_fields(engine: Engine, last: Output) -> dict[str, Any]:
    if engine.config.engine_flavor == "vllm":  # vLLM: the stop string/token that ended it, None for EOS
        user_stop = last.matched_stop if last.matched_stop != engine.eos_token_id else None
        return {"stop_reason": user_stop if last.finish_reason == "stop" else None}
    return {"matched_stop": last.matched_stop}


def _prompt_ids(engine: Engine, body: CompletionRequest) -> list[int]:
    prompt: Any = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise RequestError(f"batched prompts ({len(prompt)}) are not supported: send one prompt per request",
                               param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return engine.tokenizer.encode(prompt, add_special_tokens=True)
    return list(prompt)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    engine = engine_of(request)
    require_ready(engine)
    body = await parse_body(request, ChatCompletionRequest)
    _check_common(engine, body)
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    prompt_ids = engine.tokenizer.chat_ids(
        messages, add_generation_prompt=body.add_generation_prompt, tools=body.tools, extra=body.chat_template_kwargs
    )
    rid = request_id(request, body.rid, body.request_id)
    return await _respond(request, engine, body, _params(rid, prompt_ids, body, body.token_limit), CHAT, "")


async def completions(request: web.Request) -> web.StreamResponse:
    engine = engine_of(request)
    require_ready(engine)
    body = await parse_body(request, CompletionRequest)
    _check_common(engine, body)
    prompt_ids = _prompt_ids(engine, body)
    rid = request_id(request, body.rid, body.request_id)
    params = _params(rid, prompt_ids, body, body.token_limit)
    echo = ""
    if body.echo:
        echo = body.prompt if isinstance(body.prompt, str) else engine.tokenizer.decode(prompt_ids)
    return await _respond(request, engine, body, params, COMPLETION, echo)


async def _respond(request: web.Request, engine: Engine, body: _OpenAIRequest, params: GenerationParams,
                   shape: _Shape, echo: str) -> web.StreamResponse:
    params.routing = routing(body, request.headers, engine.config.engine_flavor, engine.config.disagg)
    stream = engine.submit(params)  # raises RequestError before anything is sent
    head = {
        "id": shape.id_prefix + params.rid,
        "created": int(time.time()),
        "model": body.model or engine.config.served_model_name,
    }
    async with stream:
        if body.stream:
            return await _stream(request, engine, body, stream, shape, head, echo)
        text, _ids, last = await stream.collect()
        choice: dict[str, Any] = {"index": 0}
        if shape.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = echo + text
        choice.update(logprobs=None, finish_reason=last.finish_reason, **_stop_fields(engine, last))
        payload = {"id": head["id"], "object": shape.full_object, "created": head["created"],
                   "model": head["model"], "choices": [choice], "usage": _usage(stream)}
        if engine.config.engine_flavor == "vllm":
            payload["kv_transfer_params"] = None  # vLLM's field; its Mooncake connector returns none
        return json_response(payload, params.rid)


async def _stream(request: web.Request, engine: Engine, body: _OpenAIRequest, stream: GenerationStream,
                  shape: _Shape, head: dict[str, Any], echo: str) -> web.StreamResponse:
    sse = SseWriter(request, stream.params.rid)
    extra = {"usage": None} if body.include_usage else {}

    def chunk(choice: dict[str, Any]) -> dict[str, Any]:
        return {"id": head["id"], "object": shape.chunk_object, "created": head["created"],
                "model": head["model"], "choices": [choice], **extra}

    delta = TextSplice(dumps(chunk(shape.delta_choice(TEXT_SLOT, None))))  # the frame of each text delta
    try:
        await sse.start()
        if shape.chat:
            await sse.send(chunk(shape.delta_choice("", None, role=True)))
        elif echo:
            await sse.send_json(delta(echo))
        async for out in stream:
            if out.finish_reason is None:
                if out.text:
                    await sse.send_json(delta(out.text))
                continue
            final = shape.delta_choice(out.text or None, out.finish_reason)
            final.update(_stop_fields(engine, out))
            await sse.send(chunk(final))
        if body.include_usage:
            await sse.send({"id": head["id"], "object": shape.chunk_object, "created": head["created"],
                            "model": head["model"], "choices": [], "usage": _usage(stream)})
        return await sse.done()
    except GenerationFailed as e:  # a failed KV transfer after the stream began: an error event, then [DONE]
        try:
            await sse.send(stream_error_event(engine.config.engine_flavor, e))
            return await sse.done()
        except ConnectionError:
            return sse.response
    except ConnectionError:
        return sse.response  # client gone: leaving `async with stream` aborts the sequence


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
