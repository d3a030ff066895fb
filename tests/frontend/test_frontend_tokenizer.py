"""The shared tokenizer reproduces the engine's token ids (the token invariant)."""

import json

import pytest

from infera_common.models import default_model_path
from infera_common.schemas import Endpoint
from infera_common.tokenizer import ChatTemplateError, ChatTokenizer

from infera_frontend.prepare import tokenize
from infera_frontend.validation import parse_body


@pytest.fixture(scope="module")
def tok() -> ChatTokenizer:
    return ChatTokenizer.from_dir(default_model_path())


def test_default_model_path_is_the_bundled_tokenizer(model_dir):
    assert default_model_path() == model_dir


def test_one_user_message_becomes_35_ids_with_generation_prompt(tok):
    text = tok.render_chat([{"role": "user", "content": "1+1=?"}])
    assert text.startswith("<|im_start|>system\n")  # the template's default system prompt
    assert text.endswith("<|im_start|>user\n1+1=?<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.chat_ids([{"role": "user", "content": "1+1=?"}])
    assert len(ids) == 35
    assert ids[-4:] == tok.encode("<|im_start|>assistant\n")


def test_plain_text_encodes_without_extra_tokens(tok):
    assert tok.encode("Hello, world") == [19556, 28, 905]
    assert tok.prompt_ids("Hello, world") == [19556, 28, 905]  # SmolLM2 adds no BOS


def test_text_content_parts_render_like_a_string(tok):
    parts = [{"role": "user", "content": [{"type": "text", "text": "1+1=?"}]}]
    assert tok.chat_ids(parts) == tok.chat_ids([{"role": "user", "content": "1+1=?"}])


def test_template_without_template_raises(tmp_path, model_dir):
    (tmp_path / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    bare = ChatTokenizer.from_dir(tmp_path)
    assert not bare.has_chat_template
    with pytest.raises(ChatTemplateError):
        bare.chat_ids([{"role": "user", "content": "x"}])


def test_template_is_sandboxed(tmp_path, model_dir):
    (tmp_path / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": evil}))
    with pytest.raises(ChatTemplateError):
        ChatTokenizer.from_dir(tmp_path).render_chat([{"role": "user", "content": "x"}])


def test_missing_tokenizer_names_the_flag(tmp_path):
    with pytest.raises(FileNotFoundError, match="--model-path"):
        ChatTokenizer.from_dir(tmp_path)


def test_a_broken_tokenizer_file_is_named_with_the_flag(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0",\n')
    with pytest.raises(ValueError, match=f"cannot read the tokenizer {tmp_path / 'tokenizer.json'}: .*--model-path"):
        ChatTokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes((default_model_path() / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text("{")
    with pytest.raises(ValueError, match=f"cannot read {tmp_path / 'tokenizer_config.json'}"):
        ChatTokenizer.from_dir(tmp_path)


def test_routing_tokens_for_each_prompt_shape(tok):
    chat = parse_body(Endpoint.CHAT, b'{"model": "m", "messages": [{"role": "user", "content": "1+1=?"}]}')
    t = tokenize(tok, chat)
    assert t.ok and t.prompt_tokens == 35 and t.token_ids == tok.chat_ids([{"role": "user", "content": "1+1=?"}])

    text = tokenize(tok, parse_body(Endpoint.COMPLETIONS, b'{"model": "m", "prompt": "Hello, world"}'))
    assert text.token_ids == [19556, 28, 905] and text.prompt_tokens == 3

    ids = tokenize(tok, parse_body(Endpoint.COMPLETIONS, b'{"model": "m", "prompt": [5, 6, 7, 8]}'))
    assert list(ids.token_ids) == [5, 6, 7, 8] and ids.prompt_tokens == 4  # (the validated array itself)

    batch = tokenize(tok, parse_body(Endpoint.COMPLETIONS, b'{"model": "m", "prompt": ["Hello, world", "Hi"]}'))
    assert batch.token_ids == [19556, 28, 905] and batch.prompt_tokens == 3 + len(tok.encode("Hi"))


def test_a_template_failure_routes_without_tokens(tmp_path, model_dir):
    (tmp_path / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    strict = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}{% endif %}x"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": strict}))
    t = tokenize(ChatTokenizer.from_dir(tmp_path),
                 parse_body(Endpoint.CHAT, b'{"model": "m", "messages": [{"role": "user", "content": "x"}]}'))
    assert not t.ok and t.token_ids is None


def test_piecewise_cached_encoding_equals_one_encode_call(tok):
    import random

    random.seed(7)
    alphabet = ["a", "b", " ", "  ", "\n", "\t", "1", "23", "é", "日本", "🙂", "<|im_start|>", "<|im_end|>",
                "<|endoftext|>", "<|im_start", "|>", "'s", "Hello", ",", "!"]
    texts = ["", " ", "<|im_start|>", "<|im_start|><|im_end|>", "x<|im_end|>y", " <|im_start|> "]
    texts += ["".join(random.choice(alphabet) for _ in range(random.randint(1, 40))) for _ in range(300)]
    convo = [{"role": "system", "content": "Be brief."}]
    for turn in range(4):
        convo.append({"role": "user", "content": f"Question {turn}: what is {turn}+{turn}?  "})
        texts.append(tok.render_chat(convo))
        convo.append({"role": "assistant", "content": f" {turn * 2}\n"})
    for _ in range(2):  # second round: served from the cache
        for text in texts:
            assert tok.encode_cached(text) == tok.encode(text), repr(text)
    assert tok.cache.hits > 0


def test_a_long_prompt_encodes_to_the_same_ids_by_the_path_that_releases_the_gil(tok):
    """Past ``LONG_TEXT_CHARS`` the text goes through ``encode_batch`` (``bench/tokenizer_gil.py``
    shows the event loop it frees); the ids must be those of one plain ``encode``."""
    from infera_common.tokenizer import LONG_TEXT_CHARS

    convo = [{"role": "user", "content": "hello world, é日本🙂 <|im_end|> " * 4_000}]
    text = tok.render_chat(convo)
    assert len(text) > LONG_TEXT_CHARS
    assert tok.encode(text) == tok.tokenizer.encode(text, add_special_tokens=False).ids
    assert tok.prompt_ids(text) == tok.tokenizer.encode(text, add_special_tokens=True).ids
    assert tok.chat_ids(convo) == tok.encode(text)


def test_segment_cache_is_bounded():
    from infera_common.tokenizer import SegmentCache

    cache = SegmentCache(max_tokens=10)
    cache.put("a", [1, 2, 3, 4])
    cache.put("b", [5, 6, 7, 8])
    cache.put("c", [9, 10, 11])  # 11 ids: the oldest piece goes
    assert cache.get("a") is None and list(cache.get("b")) == [5, 6, 7, 8] and list(cache.get("c")) == [9, 10, 11]
    assert list(cache.put("huge", list(range(50)))) == list(range(50)) and cache.get("huge") is None


@pytest.mark.parametrize("text", [
    "#" * 5000, "\n" + " " * 4000, "=" * 3000 + "abc", "hello world " * 500, "日本語のテキスト" * 300,
    "<|im_start|>" * 200, "".join(chr(0x20 + (i * 7919) % 5000) for i in range(6000)),
])
def test_the_token_floor_never_exceeds_the_real_count(tok, text):
    """What the frontend refuses before tokenizing must not fit for certain (``min_tokens``)."""
    assert tok.min_tokens(len(text)) <= len(tok.encode(text, add_special_tokens=True))
    assert tok.min_tokens(len(text)) > 0
