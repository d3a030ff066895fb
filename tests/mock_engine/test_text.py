"""Tokenizer + chat template prompt ids, deterministic word generation, stop-string matching."""

import json
from pathlib import Path

import jinja2.sandbox
import pytest
from tokenizers import Tokenizer

from infera_mock_engine.stops import StopMatcher
from infera_mock_engine.textgen import TokenStream, WordVocab, stream_seed
from infera_mock_engine.tokenizer import ModelTokenizer, TemplateError


MODEL_DIR = Path(__file__).resolve().parents[2] / "libs" / "infera_common" / "models" / "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def tok():
    return ModelTokenizer(MODEL_DIR)


def test_chat_prompt_ids_match_tokenizer_and_template(tok, model_dir):
    ids = tok.chat_ids([{"role": "user", "content": "1+1=?"}])
    assert len(ids) == 35
    # the same ids as rendering the bundled template by hand and encoding without extra special tokens
    template = json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"]
    text = jinja2.sandbox.ImmutableSandboxedEnvironment().from_string(template).render(
        messages=[{"role": "user", "content": "1+1=?"}], add_generation_prompt=True)
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert ids == raw.encode(text, add_special_tokens=False).ids
    assert text.endswith("<|im_start|>assistant\n")


def test_content_parts_are_flattened_to_text(tok):
    parts = [{"type": "text", "text": "1+1=?"}]
    assert tok.chat_ids([{"role": "user", "content": parts}]) == tok.chat_ids([{"role": "user", "content": "1+1=?"}])


def test_model_without_chat_template_refuses_chat(tmp_path, model_dir):
    (tmp_path / "tokenizer.json").write_text((model_dir / "tokenizer.json").read_text())
    bare = ModelTokenizer(tmp_path)
    with pytest.raises(TemplateError):
        bare.chat_ids([{"role": "user", "content": "hi"}])


def test_generated_tokens_are_words_of_the_vocabulary(tok):
    vocab = WordVocab(tok.vocab, tok.decode)
    stream = TokenStream(vocab, 1234)
    ids = [stream() for _ in range(200)]
    text = "".join(vocab.piece(i) for i in ids)
    assert text == tok.decode(ids)  # pieces are exactly what the tokenizer decodes
    words = text.replace(",", " ").replace(".", " ").split()
    assert len(words) >= 150 and all(w.isalpha() and w.islower() for w in words)


def test_seeding_rules():
    p = [5, 6, 7]
    assert stream_seed(p, 42, 0.8) == stream_seed(p, 42, 0.8)
    assert stream_seed(p, 42, 0.8) != stream_seed(p, 43, 0.8)
    assert stream_seed(p, 42, 0.8) != stream_seed([5, 6, 8], 42, 0.8)
    assert stream_seed(p, None, 0.0) == stream_seed(p, None, 0.0)  # greedy: the prompt decides
    assert stream_seed(p, None, 0.7) is None  # sampling without a seed: random


@pytest.mark.parametrize(
    "pieces, stops, emitted, matched",
    [
        (["hello", " world"], [], "hello world", None),
        (["hel", "lo wo", "rld"], ["o w"], "hell", "o w"),
        (["ab", "c"], ["bc", "abc"], "", "abc"),  # earliest match wins
        (["one", " two", " thr"], ["three"], "one two ", None),  # held back, not emitted yet
    ],
)
def test_stop_matcher(pieces, stops, emitted, matched):
    m = StopMatcher(stops)
    out, hit = [], None
    for p in pieces:
        text, hit = m.feed(p)
        out.append(text)
        if hit:
            break
    assert "".join(out) == emitted and hit == matched


def test_stop_matcher_releases_held_text_at_the_end():
    m = StopMatcher(["three"])
    assert m.feed("one th") == ("one ", None)
    assert m.feed("r") == ("", None)
    assert m.feed("o") == ("thro", None)  # no longer a possible start of the stop string
    assert m.feed(" th") == (" ", None)
    assert m.flush() == "th"
