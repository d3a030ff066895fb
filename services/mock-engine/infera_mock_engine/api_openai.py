"""OpenAI-compatible endpoints as SGLang and vLLM serve them: /v1/chat/completions, /v1/completions.

Streaming is framed `data: {json}\\n\\n` ... `data: [DONE]\\n\\n`; the first chat chunk carries the
role, sent with the engine's first output (after prefill), as SGLang's and vLLM's serving_chat send
it; with stream_options.include_usage a last chunk with empty choices carries the usage. A
completions `prompt` may be a batch (a list of texts or of token-id lists), and `n` asks for several
samples of each prompt: one choice per sample, `index` = prompt's place × n + sample, streamed
interleaved, usage summed (each prompt counted once). Logprobs when asked (`logprobs.py`).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Coroutine
from contextlib import AsyncExitStack
from dataclasses import dataclass, replace
from typing import Any

from aiohttp import web

from infera_mock_engine.engine import Engine, GenerationFailed, GenerationParams, GenerationStream, Output, RequestError
from infera_mock_engine.errors import stream_error_event
from infera_mock_engine.kv_events import Adapter
from infera_mock_engine.api_lora import resolve
from infera_mock_engine.lora import requested
from infera_mock_engine.logprobs import LogprobBuilder
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

    def delta_choice(self, text: str | None, finish_reason: str | None, role: bool = False,
                     index: int = 0) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish_reason}


CHAT, COMPLETION = _Shape(chat=True), _Shape(chat=False)


#: vLLM's bound on ``n`` (its guard against one request fanning out without end), and where it is set.
VLLM_MAX_N_ENV, VLLM_MAX_N_DEFAULT = "VLLM_MAX_N_SEQUENCES", 16384
#: Below this temperature vLLM samples greedily (its ``_SAMPLING_EPS``).
VLLM_GREEDY_BELOW = 1e-5
#: The most stop strings vLLM takes in one request (its request models' ``StopParam``).
VLLM_MAX_STOP = 4


def _check_common(engine: Engine, body: _OpenAIRequest) -> None:
    if engine.config.engine_flavor != "vllm":
        return
    if body.model and body.model not in engine.config.served_model_names and engine.lora.get(body.model) is None \
            and not resolve(engine, body.model):
        raise RequestError(f"The model `{body.model}` does not exist.", status=404, param="model")
    max_n = int(os.environ.get(VLLM_MAX_N_ENV, VLLM_MAX_N_DEFAULT))
    if body.n > max_n:
        raise RequestError(f"n is {body.n}, above the limit of {max_n} ({VLLM_MAX_N_ENV} raises it)", param="n")
    if body.n > 1 and body.temperature is not None and body.temperature < VLLM_GREEDY_BELOW:
        raise RequestError(f"n is {body.n} with greedy sampling (temperature 0), where every sample would be "
                           "the same: n must be 1", param="n")
    # vLLM 0.32's own checks (its SamplingParams and request models), which the sglang flavour does not make
    if body.temperature is not None and body.temperature > 2.0:
        raise RequestError(f"temperature must be in [0, 2], got {body.temperature}.", param="temperature")
    if body.top_k is not None and body.top_k < -1:
        raise RequestError(f"top_k must be 0 (disable), or at least 1, got {body.top_k}.", param="top_k")
    limit = body.token_limit
    if limit is not None and body.min_tokens > limit:
        raise RequestError(f"min_tokens must be less than or equal to max_tokens={limit}, got {body.min_tokens}.",
                           param="min_tokens")
    if body.stream_options is not None and not body.stream:
        raise RequestError("Stream options can only be defined when `stream=True`.", param="stream_options")
    if isinstance(body.stop, list) and len(body.stop) > VLLM_MAX_STOP:
        raise RequestError(f"List should have at most {VLLM_MAX_STOP} items after validation, not "
                           f"{len(body.stop)}", param="stop")


def _lora(engine: Engine, body: _OpenAIRequest) -> Adapter | None:
    """The LoRA adapter the request's ``model`` names, in the flavour's syntax (None: the base model);
    SGLang refuses one it has not loaded (vLLM's unknown names are refused by ``_check_common``)."""
    cfg = engine.config
    name, asked = requested(cfg.engine_flavor, body.model, cfg.served_model_names)
    adapter = engine.lora.get(name)
    if asked and adapter is None and cfg.engine_flavor == "sglang":
        adapter = engine.lora.reload(name)  # SGLang loads again one it loaded before
        if adapter is None:
            raise RequestError(f"LoRA adapter {name!r} has never been loaded", param="model")
    return adapter


def _params(rid: str, prompt_ids: list[int], body: _OpenAIRequest, limit: int | None,
            lora: Adapter | None = None) -> GenerationParams:
    return GenerationParams(
        rid=rid,
        prompt_ids=prompt_ids,
        max_new_tokens=limit,
        stop=body.stop_list(),
        stop_token_ids=list(body.stop_token_ids or ()),
        temperature=1.0 if body.temperature is None else body.temperature,
        seed=body.seed,
        ignore_eos=body.ignore_eos,
        lora=lora,
        cache_salt=body.cache_salt,
    )


def _usage(streams: list[GenerationStream]) -> dict[str, Any]:
    """Usage of the whole request, as both engines count it: each prompt once (its first sample's
    prompt and cached tokens, whatever ``n``), every sample's completion."""
    firsts = [s for s in streams if s.params.sample == 0]
    prompt = sum(s.prompt_tokens for s in firsts)
    completion = sum(s.completion_tokens for s in streams)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(s.cached_tokens for s in firsts)},
    }


def _stop_fields(engine: Engine, last: Output) -> dict[str, Any]:
    if engine.config.engine_flavor == "vllm":  # vLLM: the stop string/token that ended it, None for EOS
        user_stop = last.matched_stop if last.matched_stop != engine.eos_token_id else None
        return {"stop_reason": user_stop if last.finish_reason == "stop" else None}
    return {"matched_stop": last.matched_stop}


def _batch(body: CompletionRequest) -> list[Any]:
    """The request's prompts: a text or a token-id list each; a batch (a list of either) gives several."""
    prompt: Any = body.prompt
    return prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]


def _prompt_ids(engine: Engine, prompt: Any) -> list[int]:
    return engine.tokenizer.encode(prompt, add_special_tokens=True) if isinstance(prompt, str) else list(prompt)


def _echo(engine: Engine, prompt: Any, prompt_ids: list[int]) -> str:
    """What `echo` puts before the completion: the prompt's text as sent, or its ids decoded."""
    return prompt if isinstance(prompt, str) else engine.tokenizer.decode(prompt_ids)


@dataclass
class _Choice:
    """One sample of one prompt within a request: its stream, echo and logprobs."""

    index: int
    stream: GenerationStream
    echo: str = ""
    logprobs: LogprobBuilder | None = None


async def chat_completions(request: web.Request) -> web.StreamResponse:
    engine = engine_of(request)
    require_ready(engine)
    body = await parse_body(request, ChatCompletionRequest)
    _check_common(engine, body)
    if engine.config.engine_flavor == "vllm" and body.tool_choice not in (None, "none") and body.tools is None:
        raise RequestError("tool_choice needs tools: set `tools`, or leave tool_choice out (vLLM refuses it alone)",
                           param="tool_choice")
    if body.top_logprobs and not body.logprobs:
        raise RequestError("when using `top_logprobs`, `logprobs` must be set to true", param="top_logprobs")
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    prompt_ids = engine.tokenizer.chat_ids(
        messages, add_generation_prompt=body.add_generation_prompt, tools=body.tools, extra=body.chat_template_kwargs
    )
    rid = request_id(request, body.rid, body.request_id)
    params = _params(rid, prompt_ids, body, body.token_limit, _lora(engine, body))
    params.prompt_param = "messages"
    return await _respond(request, engine, body, [params], CHAT, [""])


async def completions(request: web.Request) -> web.StreamResponse:
    engine = engine_of(request)
    require_ready(engine)
    body = await parse_body(request, CompletionRequest)
    _check_common(engine, body)
    if engine.config.engine_flavor == "vllm" and body.suffix is not None:
        raise RequestError("suffix is not supported by this engine (vLLM refuses it)", param="suffix")
    rid = request_id(request, body.rid, body.request_id)
    prompts = _batch(body)
    batch = [_prompt_ids(engine, p) for p in prompts]
    lora = _lora(engine, body)
    params = [_params(rid, ids, body, body.token_limit, lora) for ids in batch]
    echoes = [_echo(engine, p, ids) if body.echo else "" for p, ids in zip(prompts, batch)]
    return await _respond(request, engine, body, params, COMPLETION, echoes)


async def _respond(request: web.Request, engine: Engine, body: _OpenAIRequest, batch: list[GenerationParams],
                   shape: _Shape, echoes: list[str]) -> web.StreamResponse:
    rid = batch[0].rid
    head = {
        "id": shape.id_prefix + rid,
        "created": int(time.time()),
        "model": body.model or engine.config.served_model_name,
    }
    k = body.logprobs_k
    pinned = routing(body, request.headers, engine.config.engine_flavor, engine.config.disagg)
    async with AsyncExitStack() as held:  # leaving it early aborts every prompt's generation
        choices = []
        for i, first in enumerate(batch):
            for j in range(body.n):  # vLLM's order: prompt by prompt, each prompt's n samples
                params = replace(first, sample=j, routing=pinned)
                stream = await held.enter_async_context(engine.submit(params))  # RequestError before any byte
                lp = None if k is None else LogprobBuilder(shape.chat, k, engine.vocab.piece,
                                                           engine.tokenizer.vocab_size)
                choices.append(_Choice(i * body.n + j, stream, echoes[i], lp))
        if body.stream:
            return await _stream(request, engine, body, choices, shape, head)
        return json_response(await _whole(engine, choices, shape, head), rid)


async def _whole(engine: Engine, choices: list[_Choice], shape: _Shape, head: dict[str, Any]) -> dict[str, Any]:
    """The non-streaming answer: every prompt run to its end, one choice each."""
    if len(choices) == 1:  # the common case, without a task per choice
        results = [await choices[0].stream.collect()]
    else:
        results = await asyncio.gather(*(c.stream.collect() for c in choices))
    out = []
    for c, (text, ids, last) in zip(choices, results):
        choice: dict[str, Any] = {"index": c.index}
        if shape.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = c.echo + text
        logprobs = None
        if c.logprobs is not None:
            if c.echo:  # the prompt's tokens first, their offsets before the completion's
                echoed = c.logprobs.prompt(c.stream.params.prompt_ids, engine.tokenizer.token_text)
                logprobs = LogprobBuilder.join(echoed, c.logprobs.part(ids))
            else:
                logprobs = c.logprobs.part(ids)
        choice.update(logprobs=logprobs, finish_reason=last.finish_reason, **_stop_fields(engine, last))
        out.append(choice)
    payload = {"id": head["id"], "object": shape.full_object, "created": head["created"], "model": head["model"],
               "choices": out, "usage": _usage([c.stream for c in choices])}
    if engine.config.engine_flavor == "vllm":
        payload["kv_transfer_params"] = None  # vLLM's field; its Mooncake connector returns none
    return payload


async def _stream(request: web.Request, engine: Engine, body: _OpenAIRequest, choices: list[_Choice],
                  shape: _Shape, head: dict[str, Any]) -> web.StreamResponse:
    sse = SseWriter(request, choices[0].stream.params.rid)
    # with include_usage, SGLang's other chunks say "usage": null and vLLM's leave it out
    extra = {"usage": None} if body.include_usage and engine.config.engine_flavor != "vllm" else {}
    so_far = body.continuous_usage

    def chunk(choice: dict[str, Any], opening: bool = False) -> dict[str, Any]:
        out = {"id": head["id"], "object": shape.chunk_object, "created": head["created"],
               "model": head["model"], "choices": [choice], **extra}
        if so_far:  # continuous_usage_stats: this choice's usage so far, on every chunk (none yet in the role's)
            s = choices_by_index[choice["index"]].stream
            done = 0 if opening else s.completion_tokens
            out["usage"] = {"prompt_tokens": s.prompt_tokens, "completion_tokens": done,
                            "total_tokens": s.prompt_tokens + done}
        return out

    choices_by_index = {c.index: c for c in choices}

    async def relay(c: _Choice) -> None:
        """One choice's chunks, tagged with its index (interleaved with the others', as vLLM's are)."""
        fast = c.logprobs is None and not so_far  # the common case: each text delta spliced into a fixed frame
        delta = TextSplice(dumps(chunk(shape.delta_choice(TEXT_SLOT, None, index=c.index)))) if fast else None
        opened = False
        async for out in c.stream:
            if not opened:  # as both engines do, once the engine's first output is in: not before prefill
                opened = True
                if shape.chat:
                    await sse.send(chunk(shape.delta_choice("", None, role=True, index=c.index), opening=True))
                elif c.echo:
                    first = shape.delta_choice(c.echo, None, index=c.index)
                    if c.logprobs is not None:
                        first["logprobs"] = c.logprobs.prompt(c.stream.params.prompt_ids, engine.tokenizer.token_text)
                    await sse.send(chunk(first))
            if out.finish_reason is None:
                if not out.text and not out.token_ids:
                    continue
                if delta is not None:
                    if out.text:
                        await sse.send_json(delta(out.text))
                    continue
                part = shape.delta_choice(out.text, None, index=c.index)
                if c.logprobs is not None:
                    part["logprobs"] = c.logprobs.part(out.token_ids)
                await sse.send(chunk(part))
                continue
            final = shape.delta_choice(out.text or None, out.finish_reason, index=c.index)
            if c.logprobs is not None:
                final["logprobs"] = c.logprobs.part(out.token_ids)
            final.update(_stop_fields(engine, out))
            await sse.send(chunk(final))

    try:
        await sse.start()
        if len(choices) == 1:
            await relay(choices[0])
        else:
            await _together([relay(c) for c in choices])
        if body.include_usage:
            await sse.send({"id": head["id"], "object": shape.chunk_object, "created": head["created"],
                            "model": head["model"], "choices": [], "usage": _usage([c.stream for c in choices])})
        return await sse.done()
    except GenerationFailed as e:  # a failed KV transfer after the stream began: an error event, then [DONE]
        try:
            await sse.send(stream_error_event(engine.config.engine_flavor, e))
            return await sse.done()
        except ConnectionError:
            return sse.response
    except ConnectionError:
        return sse.response  # client gone: leaving `async with` aborts the sequences


async def _together(coros: list[Coroutine[Any, Any, None]]) -> None:
    """Run them all; the first to fail stops the others, and its exception is raised."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
