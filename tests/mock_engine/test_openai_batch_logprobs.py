"""Batched completions prompts, n samples and logprobs, as vLLM and SGLang serve them on their OpenAI API."""

from __future__ import annotations

import asyncio

import pytest

CHAT = {"messages": [{"role": "user", "content": "Name three rivers."}]}


@pytest.mark.parametrize("flavor", ["sglang", "vllm"])
async def test_a_batch_of_text_prompts_gets_one_choice_each_and_summed_usage(start_engine, flavor):
    client = await start_engine("--speedup", "10", "--engine-flavor", flavor)
    model = client.server.engine.config.served_model_name
    prompts = ["The capital of France is", "Once upon a time"]
    single = [await client.post("/v1/completions", {"model": model, "prompt": p, "max_tokens": 5, "seed": 1})
              for p in prompts]
    status, body = await client.post("/v1/completions", {"model": model, "prompt": prompts, "max_tokens": 5,
                                                         "seed": 1})
    assert status == 200, body
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [c["text"] for c in body["choices"]] == [s[1]["choices"][0]["text"] for s in single]
    assert body["usage"]["prompt_tokens"] == sum(s[1]["usage"]["prompt_tokens"] for s in single)
    assert body["usage"]["completion_tokens"] == 10


async def test_a_streamed_batch_of_token_id_prompts_interleaves_its_choices(start_engine):
    client = await start_engine("--speedup", "10")
    _, events = await client.sse("/v1/completions", {"prompt": [[1, 2, 3, 4], [5, 6, 7]], "max_tokens": 6,
                                                     "stream": True, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    by_index = {0: [], 1: []}
    for c in chunks:
        by_index[c["choices"][0]["index"]].append(c["choices"][0])
    assert all(parts[-1]["finish_reason"] == "length" for parts in by_index.values())
    first_end = min(i for i, c in enumerate(chunks) if c["choices"][0]["finish_reason"])
    assert {c["choices"][0]["index"] for c in chunks[:first_end]} == {0, 1}  # both ran at once
    assert events[-2]["usage"]["prompt_tokens"] == 7 and events[-2]["usage"]["completion_tokens"] == 12


async def test_leaving_a_batch_early_aborts_every_prompt(start_engine):
    client = await start_engine("--speedup", "10")
    async with client.session.post("/v1/completions", json={"prompt": ["a", "b", "c"], "max_tokens": 3000,
                                                            "stream": True}) as r:
        await r.content.readline()
        assert client.server.engine.totals().running == 3
    for _ in range(50):
        if client.server.engine.totals().running == 0:
            break
        await asyncio.sleep(0.05)
    assert client.server.engine.totals().running == 0


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_logprobs_one_entry_per_token_with_its_alternatives(start_engine, stream):
    client = await start_engine("--speedup", "10", "--engine-flavor", "vllm")
    body = {**CHAT, "model": client.server.engine.config.served_model_name, "max_tokens": 7, "seed": 3,
            "logprobs": True, "top_logprobs": 3}
    if stream:
        _, events = await client.sse("/v1/chat/completions", {**body, "stream": True})
        parts = [e["choices"][0] for e in events[:-1] if e["choices"]]
        text = "".join(p["delta"].get("content") or "" for p in parts)
        content = [entry for p in parts if p["logprobs"] for entry in p["logprobs"]["content"]]
    else:
        status, answer = await client.post("/v1/chat/completions", body)
        assert status == 200, answer
        text = answer["choices"][0]["message"]["content"]
        content = answer["choices"][0]["logprobs"]["content"]
    assert len(content) == 7
    assert "".join(e["token"] for e in content) == text
    for e in content:
        assert e["logprob"] <= 0 and bytes(e["bytes"]).decode() == e["token"]
        tops = e["top_logprobs"]
        assert len(tops) == 3 and tops[0]["token"] == e["token"]
        assert [t["logprob"] for t in tops] == sorted((t["logprob"] for t in tops), reverse=True)
    again = await client.post("/v1/chat/completions", body)  # the same seed: the same logprobs
    assert [e["logprob"] for e in again[1]["choices"][0]["logprobs"]["content"]] == [e["logprob"] for e in content]


async def test_no_logprobs_unless_asked(start_engine):
    client = await start_engine("--speedup", "10")
    status, body = await client.post("/v1/chat/completions", {**CHAT, "max_tokens": 3})
    assert status == 200 and body["choices"][0]["logprobs"] is None


async def test_completion_logprobs_with_echo_start_with_the_prompt(start_engine):
    client = await start_engine("--speedup", "10")
    status, body = await client.post("/v1/completions", {"prompt": [10, 20, 30], "max_tokens": 4, "logprobs": 2,
                                                         "echo": True})
    assert status == 200, body
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 3 + 4 == len(lp["token_logprobs"]) == len(lp["text_offset"])
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(x <= 0 for x in lp["token_logprobs"][1:])
    assert "".join(lp["tokens"]) == body["choices"][0]["text"]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(7)]
    assert all(lp["tokens"][i] in lp["top_logprobs"][i] and len(lp["top_logprobs"][i]) <= 3 for i in range(1, 7))


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
])
async def test_logprobs_beyond_what_the_engine_allows_are_refused(start_engine, path, body, param):
    client = await start_engine()
    status, answer = await client.post(path, body)
    assert status == 400 and param in (answer.get("param") or answer["message"]), answer


async def test_an_over_long_prompt_is_blamed_on_the_field_that_holds_it(start_engine):
    client = await start_engine("--context-length", "64")
    status, body = await client.post("/v1/completions", {"prompt": list(range(1, 100)), "max_tokens": 1})
    assert status == 400 and body["param"] == "prompt"
    status, body = await client.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x " * 80}]})
    assert status == 400 and body["param"] == "messages"


async def test_n_samples_of_each_prompt_in_vllms_order_with_the_prompt_counted_once(start_engine):
    client = await start_engine("--speedup", "10")
    one = await client.post("/v1/completions", {"prompt": "Tell me", "max_tokens": 4, "seed": 9, "temperature": 0.7})
    status, body = await client.post("/v1/completions", {"prompt": ["Tell me", "Show me"], "max_tokens": 4,
                                                         "n": 2, "seed": 9, "temperature": 0.7})
    assert status == 200, body
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["choices"][0]["text"] == one[1]["choices"][0]["text"]  # sample 0 is what n=1 gives
    assert body["choices"][0]["text"] != body["choices"][1]["text"]
    assert body["usage"]["prompt_tokens"] == 2 * one[1]["usage"]["prompt_tokens"]  # each prompt once
    assert body["usage"]["completion_tokens"] == 16
    greedy = await client.post("/v1/chat/completions", {**CHAT, "max_tokens": 5, "n": 3, "temperature": 0})
    assert len({c["message"]["content"] for c in greedy[1]["choices"]}) == 1  # greedy samples agree
    _, events = await client.sse("/v1/chat/completions", {**CHAT, "max_tokens": 3, "n": 2, "stream": True})
    finished = [e["choices"][0]["index"] for e in events[:-1] if e["choices"] and e["choices"][0]["finish_reason"]]
    assert sorted(finished) == [0, 1]


async def test_the_vllm_flavour_refuses_what_vllm_refuses(start_engine, monkeypatch):
    """n past VLLM_MAX_N_SEQUENCES, several greedy samples, a completions suffix, tool_choice without tools."""
    monkeypatch.setenv("VLLM_MAX_N_SEQUENCES", "4")  # read per request, as vLLM reads its env
    client = await start_engine("--speedup", "10", "--engine-flavor", "vllm")
    status, body = await client.post("/v1/completions", {"prompt": "Tell me", "max_tokens": 2, "n": 5})
    assert status == 400 and body["error"]["param"] == "n" and "VLLM_MAX_N_SEQUENCES" in body["error"]["message"]
    status, body = await client.post("/v1/chat/completions", {**CHAT, "max_tokens": 2, "n": 2, "temperature": 0})
    assert status == 400 and body["error"]["param"] == "n" and "greedy" in body["error"]["message"]
    status, body = await client.post("/v1/completions", {"prompt": "Tell me", "max_tokens": 2, "n": 4})
    assert status == 200 and len(body["choices"]) == 4
    status, body = await client.post("/v1/completions", {"prompt": "Tell me", "max_tokens": 2, "suffix": "x"})
    assert status == 400 and body["error"]["param"] == "suffix"
    status, body = await client.post("/v1/chat/completions", {**CHAT, "max_tokens": 2, "tool_choice": "auto"})
    assert status == 400 and body["error"]["param"] == "tool_choice"
    status, _ = await client.post("/v1/chat/completions", {**CHAT, "max_tokens": 2, "tool_choice": "none"})
    assert status == 200
