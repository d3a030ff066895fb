"""Chat template + tokenization, the way the engines do it, so routing sees the engine's token ids.

The token invariant (DESIGN.md): the ids the router hashes must be exactly the ids the engine
caches. Engines render the model's ``chat_template`` (Jinja, from ``tokenizer_config.json``) with
``add_generation_prompt=True`` and encode the result *without* adding special tokens (the template
already holds them); a raw ``/v1/completions`` text prompt is encoded *with* the tokenizer's
special tokens (its post-processor, e.g. a BOS), and a prompt given as token ids is used as is.

``ChatTokenizer`` does exactly that with the ``tokenizers`` library and a sandboxed Jinja
environment; the compiled template is kept, so a render is a plain function call. No I/O after
``ChatTokenizer.from_dir``. ``tokenizers``' ``encode`` holds the GIL for the whole call (a 6 MB
prompt: ~4 s in which no other thread of the process runs, the event loop included), its
``encode_batch`` releases it: texts longer than ``LONG_TEXT_CHARS`` go through ``encode_batch`` (the
same ids), so callers may run very long prompts in a worker thread while the loop serves on.

Encoding costs ~1-2.5 us per token, and chat prompts repeat themselves (the system prompt, every
earlier turn of a conversation). ``tokenizers`` cuts a text at its added tokens (``<|im_start|>``
...) and encodes the pieces between them independently, so the pieces' ids can be cached: the
result is identical to one ``encode`` call. The cache is used only when every added token is a
plain one (no lstrip/rstrip/single_word/normalized matching), where that identity holds.
"""

from __future__ import annotations

import json
import re
import threading
from array import array
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

#: Separator used when a message's content is a list of text parts (OpenAI content parts).
TEXT_PART_SEPARATOR = "\n"


class ChatTemplateError(ValueError):
    """The chat template could not render these messages (the template raised, or it is missing)."""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _token_text(value: Any) -> str | None:
    """A special token in tokenizer_config.json is a string or an AddedToken dict with 'content'."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _pick_template(raw: Any) -> str | None:
    """``chat_template`` is a string, or a list of {"name", "template"} with a "default" entry."""
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list):
        named = {t.get("name"): t.get("template") for t in raw if isinstance(t, Mapping)}
        chosen = named.get("default")
        return chosen if isinstance(chosen, str) else None
    return None


def flatten_content(content: Any) -> Any:
    """Content as the engines hand it to a string-content template.

    ``None`` becomes ``""`` (an assistant turn holding only tool calls); a list of content parts
    becomes its text parts joined by ``TEXT_PART_SEPARATOR`` (non-text parts are not part of the
    routing text); a string is kept.
    """
    if content is None:
        return ""
    if isinstance(content, list):
        texts = [p["text"] for p in content if isinstance(p, Mapping) and isinstance(p.get("text"), str)]
        return TEXT_PART_SEPARATOR.join(texts)
    return content


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages ready for rendering: content flattened, everything else (tool_calls, name...) kept."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            out.append(m if isinstance(m, dict) else dict(m))
        else:
            d = dict(m)
            d["content"] = flatten_content(content)
            out.append(d)
    return out


#: Texts longer than this (characters) are encoded with the GIL released (module doc).
LONG_TEXT_CHARS = 8_192


class SegmentCache:
    """Token ids of text pieces, oldest dropped first once ``max_tokens`` ids are held. Thread-safe."""

    def __init__(self, max_tokens: int = 1_000_000, max_chars: int = 262_144) -> None:
        self.max_tokens = max_tokens
        self.max_chars = max_chars  # longer pieces are encoded but not kept
        self._ids: dict[str, array] = {}
        self._tokens = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, piece: str) -> array | None:
        found = self._ids.get(piece)
        if found is not None:
            self.hits += 1
        return found

    def put(self, piece: str, ids: list[int]) -> array:
        stored = array("I", ids)
        self.misses += 1
        if len(piece) > self.max_chars or len(stored) > self.max_tokens:
            return stored
        with self._lock:
            if piece not in self._ids:
                self._ids[piece] = stored
                self._tokens += len(stored)
            while self._tokens > self.max_tokens:
                oldest = next(iter(self._ids))
                self._tokens -= len(self._ids.pop(oldest))
        return stored

    def __len__(self) -> int:
        return len(self._ids)


def _plain_added_tokens(tokenizer: Tokenizer) -> dict[str, int] | None:
    """Added tokens by content, if all of them match as plain substrings (else ``None``)."""
    out: dict[str, int] = {}
    for token_id, tok in tokenizer.get_added_tokens_decoder().items():
        if tok.single_word or tok.lstrip or tok.rstrip or tok.normalized:
            return None
        out[tok.content] = token_id
    return out


class ChatTokenizer:
    """One model's tokenizer and chat template."""

    def __init__(self, tokenizer: Tokenizer, chat_template: str | None, special_tokens: dict[str, str]) -> None:
        self.tokenizer = tokenizer
        self.chat_template_source = chat_template
        self._special = special_tokens
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self._template = env.from_string(chat_template) if chat_template else None
        self._added = _plain_added_tokens(tokenizer)
        self._split_re: re.Pattern[str] | None = None
        if self._added:
            # longest first: at one position the longest added token wins, as in tokenizers
            alternatives = sorted(self._added, key=len, reverse=True)
            self._split_re = re.compile("|".join(re.escape(a) for a in alternatives))
        self.cache = SegmentCache()
        # the most characters one token stands for: every vocabulary entry's text (a byte-level
        # entry's characters are its bytes, which decode to no more characters), four times over
        # when a normalizer may fold several characters into one first (NFC composing, say)
        longest = max(map(len, tokenizer.get_vocab()), default=1)
        self.max_chars_per_token = longest * (1 if tokenizer.normalizer is None else 4)

    def min_tokens(self, chars: int) -> int:
        """The fewest tokens a text of ``chars`` characters can become: a bound known before tokenizing."""
        return chars // self.max_chars_per_token

    @classmethod
    def from_dir(cls, path: str | Path) -> ChatTokenizer:
        """Load ``tokenizer.json`` (+ ``tokenizer_config.json`` for the template and special tokens)."""
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path} (pass the model directory with --model-path)")
        config: dict[str, Any] = {}
        cfg_file = path / "tokenizer_config.json"
        try:
            tokenizer = Tokenizer.from_file(str(tok_file))
        except Exception as exc:  # the library's own error says what is wrong inside, not which file
            raise ValueError(f"cannot read the tokenizer {tok_file}: {exc} (the model directory given with --model-path"
                             " / --router-tokenizer-path must hold the model's own tokenizer files)") from exc
        if cfg_file.is_file():
            try:
                config = json.loads(cfg_file.read_text(encoding="utf-8"))
            except ValueError as exc:
                raise ValueError(f"cannot read {cfg_file}: {exc}") from exc
        template = _pick_template(config.get("chat_template"))
        jinja_file = path / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        special = {
            name: text
            for name in ("bos_token", "eos_token", "pad_token", "unk_token")
            if (text := _token_text(config.get(name))) is not None
        }
        return cls(tokenizer, template, special)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Any = None,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text the engine builds from ``messages``; raises ``ChatTemplateError``."""
        if self._template is None:
            raise ChatTemplateError("the model has no chat_template")
        context: dict[str, Any] = dict(self._special)
        if template_kwargs:
            context.update(template_kwargs)
        context["messages"] = template_messages(messages)
        context["add_generation_prompt"] = add_generation_prompt
        if tools is not None:
            context["tools"] = tools
        try:
            return self._template.render(context)
        except Exception as exc:  # TemplateError, TypeError from bad content, ...
            raise ChatTemplateError(f"chat template failed: {exc}") from exc

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if len(text) > LONG_TEXT_CHARS:  # the GIL released meanwhile (module doc)
            return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_cached(self, text: str) -> list[int]:
        """``encode(text)`` without special tokens added, reusing the ids of pieces seen before."""
        split = self._split_re
        if split is None:
            return self.encode(text)
        out: list[int] = []
        pos = 0
        for m in split.finditer(text):
            start = m.start()
            if start > pos:
                out.extend(self._piece(text[pos:start]))
            out.append(self._added[m.group()])  # type: ignore[index]
            pos = m.end()
        if pos < len(text):
            out.extend(self._piece(text[pos:]))
        return out

    def _piece(self, piece: str) -> array:
        ids = self.cache.get(piece)
        if ids is None:
            ids = self.cache.put(piece, self.encode(piece))
        return ids

    def chat_ids(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Any = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of the rendered chat prompt (generation prompt added, no extra special tokens)."""
        text = self.render_chat(messages, tools=tools, template_kwargs=template_kwargs)
        return self.encode_cached(text)

    def prompt_ids(self, prompt: str) -> list[int]:
        """Token ids of a ``/v1/completions`` text prompt (the tokenizer's special tokens added)."""
        return self.encode(prompt, add_special_tokens=True)
