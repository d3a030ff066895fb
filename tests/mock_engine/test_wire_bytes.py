"""What the engine's fast paths write is what the straightforward code wrote: streamed frames are the JSON
of the whole object, a seed gives the same text, a KV block the same hash, and request bodies are read
(and refused) as before."""

from array import array

import pytest

from infera_mock_engine.api_openai import CHAT, COMPLETION
from infera_mock_engine.block_hasher import BlockHasher
from infera_mock_engine.http_common import dumps
from infera_mock_engine.sse_frames import TEXT_SLOT, CumulativeOutput, TextSplice
from infera_mock_engine.textgen import ids_bytes, stream_seed

TEXTS = ["", " word", 'a "quote"', "back\\slash", "line\nbreak\ttab\r", "\x00\x01\x1f\x7f", "ünïcødé ✓", "😀",
         TEXT_SLOT, "</script>", "\u2028\u2029"]
ODD = ['x"y', TEXT_SLOT, f'{TEXT_SLOT}","choices":[', "ü\\"]


@pytest.mark.parametrize("shape", [CHAT, COMPLETION])
@pytest.mark.parametrize("extra", [{}, {"usage": None}])
@pytest.mark.parametrize("odd", ODD)
def test_a_text_delta_frame_is_the_json_of_its_whole_chunk(shape, extra, odd):
    head = {"id": f"cmpl-{odd}", "object": shape.chunk_object, "created": 1700000000, "model": odd}

    def chunk(text: str) -> dict:
        return {**head, "choices": [shape.delta_choice(text, None)], **extra}

    frame = TextSplice(dumps(chunk(TEXT_SLOT)))
    for text in TEXTS:
        assert frame(text) == dumps(chunk(text))


def test_a_generate_frame_carries_everything_so_far_as_json_would():
    so_far = CumulativeOutput()
    text, ids = "", []
    for piece, new_ids in [("", []), (" a", [5]), ('"q"\n', [6, 7]), ("", []), ("ü😀\x00\\", [49151]), (" b", [0])]:
        so_far.add(piece, new_ids)
        text, ids = text + piece, ids + new_ids
        meta = {"id": "r", "finish_reason": None, "completion_tokens": len(ids), "e2e_latency": 0.125}
        assert so_far.frame(dumps(meta)) == dumps({"text": text, "output_ids": ids, "meta_info": meta})


def test_seeds_and_block_hashes_keep_their_values():
    # a seed's text and the KV-event hashes (with PYTHONHASHSEED) stay what they were. The seeds are
    # those of session 18's packed ids (the decimal text of every id before: ~1.4 ms a 16k-token prompt)
    assert stream_seed([5, 6, 7], 42, 0.8) == 3839988069647748288
    assert stream_seed([5, 6, 7], None, 0.0) == 13831254622830877925
    for same in ([49150, 49151, 0, 7], (49150, 49151, 0, 7), array("I", [49150, 49151, 0, 7])):
        assert stream_seed(same, None, 0.0) == 1282193079540041369  # whatever holds the ids
    assert ids_bytes([1, 2**32 - 1]) == b"u32:" + bytes([1, 0, 0, 0, 255, 255, 255, 255])
    for odd in ([2**32], [-1, 2], [2**70]):  # outside 32 bits: the decimal text, never a collision
        assert ids_bytes(odd) == b"dec:" + ",".join(map(str, odd)).encode()
    assert len({stream_seed(ids, None, 0.0) for ids in ([2**32], [0], [-1], [2**32, 0], [0, 0])}) == 5
    hasher = BlockHasher(b"seed", signed=True)
    first = hasher.digest(None, [1, 2, 3, 4])
    assert first.hex() == "fe5941559f258af62ce5e323d0bdc48b"
    assert hasher.digest(first, [5, 6, 7, 8]).hex() == "4ba007b1f6847cc5a8f2959b64465264"
    assert hasher.external(first) == -118992079150544138


async def test_a_stream_with_odd_names_decodes_to_the_non_streamed_answer(engine):
    for odd in ODD:
        req = {"model": odd, "rid": 'r"1', "prompt": "Once upon a time", "max_tokens": 12, "seed": 5}
        _, full = await engine.post("/v1/completions", req)
        _, events = await engine.sse("/v1/completions", {**req, "stream": True, "echo": True})
        chunks = events[:-1]
        assert all(c["model"] == odd and c["id"] == 'cmpl-r"1' for c in chunks)
        text = "".join(c["choices"][0]["text"] for c in chunks)
        assert text == "Once upon a time" + full["choices"][0]["text"]


async def test_request_bodies_are_read_and_refused_as_before(engine):
    cases = [
        (b"{not json", 400, "the request body is not valid JSON"),
        (b"[1, 2]", 400, "the request body must be a JSON object"),
        (b"", 400, "the request body must be a JSON object"),
        (b'{"prompt": [1, 2], "max_tokens": 0}', 400, "max_tokens"),
        ('{"prompt": [1, 2], "max_tokens": 2}'.encode("utf-16"), 200, None),  # json.loads reads UTF-16 too
        (b'\xef\xbb\xbf{"prompt": [1, 2], "max_tokens": 2}', 200, None),  # and a UTF-8 byte-order mark
    ]
    for raw, status, needle in cases:
        async with engine.session.post("/v1/completions", data=raw, headers={"Content-Type": "application/json"}) as r:
            body = await r.json(content_type=None)
        assert r.status == status, (raw, body)
        if needle:
            assert needle in body["message"] or needle == body["param"], (raw, body)


async def test_a_lone_surrogate_or_a_control_character_in_an_id_is_a_clean_answer(engine):
    bad_text = [("/v1/completions", b'{"prompt": "\\ud800x", "max_tokens": 2}'),
                ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800x"}], "max_tokens": 2}')]
    for path, raw in bad_text:  # JSON may escape half a surrogate pair; the tokenizer takes UTF-8 only
        async with engine.session.post(path, data=raw, headers={"Content-Type": "application/json"}) as r:
            body = await r.json(content_type=None)
        assert r.status == 400 and "lone surrogate" in body["message"], (path, body)
    for stream in (False, True):  # an rid no header can carry: answered, the id in the body only
        req = {"text": "hi", "rid": "a\u0001b", "stream": stream, "sampling_params": {"max_new_tokens": 2}}
        async with engine.session.post("/generate", json=req) as r:
            raw = await r.read()
        assert r.status == 200 and "X-Request-Id" not in r.headers and b'"id":"a\\u0001b"' in raw
