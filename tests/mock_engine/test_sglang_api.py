"""SGLang native /generate, /abort_request, and aborting on client disconnect."""

import asyncio
import json

from .conftest import wait_until

LONG = 4000  # tokens: ~25 s of modelled decode at speedup 1 — only ever ended by an abort


async def test_generate_text_and_input_ids(engine):
    status, body = await engine.post("/generate", {"text": "The capital of France is",
                                                   "sampling_params": {"max_new_tokens": 5}, "rid": "g1"})
    assert status == 200 and body["text"].strip() and len(body["output_ids"]) == 5
    meta = body["meta_info"]
    assert meta["id"] == "g1" and meta["prompt_tokens"] == 5 and meta["completion_tokens"] == 5
    assert meta["cached_tokens"] == 0 and meta["finish_reason"] == {"type": "length", "length": 5}
    status, body = await engine.post("/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
    assert status == 200 and body["meta_info"]["prompt_tokens"] == 3


async def test_generate_stream_is_cumulative_then_done(engine):
    raw, events = await engine.sse("/generate", {"input_ids": [4, 5, 6], "stream": True,
                                                 "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    assert events[-1] == "[DONE]"
    frames = events[:-1]
    texts = [f["text"] for f in frames]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert [f["meta_info"]["finish_reason"] for f in frames[:-1]] == [None] * (len(frames) - 1)
    assert frames[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    _, body = await engine.post("/generate", {"input_ids": [4, 5, 6],
                                              "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    assert body["text"] == texts[-1]


async def test_generate_stop_and_default_length(start_engine):
    client = await start_engine("--speedup", "50", "--mock-output-len", "6")
    _, body = await client.post("/generate", {"text": "hi", "sampling_params": {"temperature": 0}})
    assert body["meta_info"]["completion_tokens"] == 6
    assert body["meta_info"]["finish_reason"]["type"] == "stop"  # a simulated EOS
    word = body["text"].split()[2]
    _, cut = await client.post("/generate", {"text": "hi", "sampling_params": {"temperature": 0, "stop": [word]}})
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": word}
    assert word not in cut["text"] and body["text"].startswith(cut["text"])


async def test_generate_validation(engine):
    for bad in ({"sampling_params": {}}, {"text": "a", "input_ids": [1]}, {"text": ["a", "b"]},
                {"text": "a", "sampling_params": {"n": 2}}, {"text": "a", "sampling_params": {"max_new_tokens": -1}}):
        status, err = await engine.post("/generate", bad)
        assert status == 400 and err["object"] == "error", bad


async def _running(client) -> float:
    return await client.metric("sglang:num_running_reqs")


async def test_abort_request_stops_a_streaming_generation(start_engine):
    client = await start_engine()
    body = {"input_ids": [1, 2, 3], "stream": True, "rid": "to-abort", "sampling_params": {"max_new_tokens": LONG}}
    async with client.session.post("/generate", json=body) as r:
        first = await r.content.readuntil(b"\n\n")
        assert json.loads(first[6:])["meta_info"]["finish_reason"] is None
        assert await _running(client) == 1
        async with client.session.post("/abort_request", json={"rid": "to-abort"}) as a:
            assert a.status == 200
        rest = (await r.read()).decode()
    frames = [json.loads(f[6:]) for f in rest.strip().split("\n\n") if f != "data: [DONE]"]
    assert frames[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert rest.endswith("data: [DONE]\n\n")
    assert await _running(client) == 0


async def test_abort_request_ends_a_non_streaming_generation(start_engine):
    client = await start_engine()
    task = asyncio.create_task(client.post("/v1/completions", {"prompt": "x", "max_tokens": LONG},
                                           headers={"X-Request-Id": "nonstream"}))
    await wait_until(lambda: _is(client, 1))
    status, _ = await client.post("/abort_request", {"rid": "nonstream"})
    status, body = await asyncio.wait_for(task, 10)
    assert status == 200 and body["choices"][0]["finish_reason"] == "abort"
    assert body["usage"]["completion_tokens"] < LONG
    assert await _running(client) == 0


async def test_abort_all(start_engine):
    client = await start_engine()
    tasks = [asyncio.create_task(client.post("/generate", {"input_ids": [i + 1], "sampling_params":
                                                           {"max_new_tokens": LONG}})) for i in range(3)]
    await wait_until(lambda: _is(client, 3))
    await client.post("/abort_request", {"abort_all": True})
    results = await asyncio.wait_for(asyncio.gather(*tasks), 10)
    assert all(b["meta_info"]["finish_reason"]["type"] == "abort" for _, b in results)
    assert await _running(client) == 0


async def _is(client, n: int) -> bool:
    return await _running(client) == n


async def test_client_disconnect_mid_stream_aborts(start_engine):
    client = await start_engine()
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": LONG, "stream": True}
    async with client.session.post("/v1/chat/completions", json=body) as r:
        await r.content.readuntil(b"\n\n")
        await r.content.readuntil(b"\n\n")
        assert await _running(client) == 1
        r.close()  # drop the connection mid-stream
    await wait_until(lambda: _is(client, 0))
    assert client.server.engine.kv.used_blocks == 0


async def test_client_disconnect_while_waiting_for_a_non_streaming_answer_aborts(start_engine):
    client = await start_engine()
    payload = json.dumps({"text": "hello", "sampling_params": {"max_new_tokens": LONG}}).encode()
    reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
    writer.write(b"POST /generate HTTP/1.1\r\nHost: engine\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
    await writer.drain()
    await wait_until(lambda: _is(client, 1))
    writer.close()
    await writer.wait_closed()
    await wait_until(lambda: _is(client, 0))
