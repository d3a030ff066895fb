"""The model's real tokenizer (tokenizer.json) and chat template (tokenizer_config.json).

Chat prompts are rendered the way Hugging Face renders them (sandboxed Jinja2, trim_blocks,
lstrip_blocks, loop controls, `raise_exception`, `tojson`, `strftime_now`, the special tokens as
variables, add_generation_prompt=True) and the rendered text is encoded without adding special
tokens again — so the prompt ids are exactly the ids a real engine caches.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer

from infera_mock_engine.engine_errors import RequestError


class TemplateError(ValueError):
    """The chat template cannot render these messages (a client error)."""


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


def load_chat_template(model_dir: Path) -> str | None:
    """The model's default chat template: tokenizer_config.json `chat_template`, else chat_template.jinja."""
    cfg_file = model_dir / "tokenizer_config.json"
    if cfg_file.is_file():
        template = json.loads(cfg_file.read_text()).get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        if template:
            return template
    jinja_file = model_dir / "chat_template.jinja"
    return jinja_file.read_text() if jinja_file.is_file() else None


def flatten_content(content: Any) -> Any:
    """OpenAI content parts → one string (text parts joined by newlines); strings pass through."""
    if isinstance(content, list):
        texts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        return "\n".join(texts)
    return "" if content is None else content


def _is_utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


class ModelTokenizer:
    def __init__(self, tokenizer_dir: str | Path) -> None:
        d = Path(tokenizer_dir)
        self.dir = d
        self.tokenizer = Tokenizer.from_file(str(d / "tokenizer.json"))
        # The library builds its whole vocabulary map to count it (~12 ms for a 49k vocabulary):
        # counted once here, since every token-id prompt is checked against it.
        self._vocab_size = self.tokenizer.get_vocab_size()
        cfg_file = d / "tokenizer_config.json"
        self.config: dict[str, Any] = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        self.chat_template = load_chat_template(d)
        self._template: jinja2.Template | None = None
        if self.chat_template:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
            )
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template)
        self.special = {
            name: _token_text(self.config.get(name))
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
        }

    @property
    def vocab(self) -> Mapping[str, int]:
        return self.tokenizer.get_vocab()

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:  # the library takes UTF-8 only: a lone surrogate (JSON "\ud800") has none
            if not _is_utf8(text):
                raise RequestError("the prompt is not valid Unicode (it holds a lone surrogate)") from None
            raise

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        """One token's text, as decoding it alone gives it."""
        return self.decode([token_id])

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Any = None,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        if self._template is None:
            raise TemplateError("this model has no chat template; use /v1/completions")
        msgs = [{**m, "content": flatten_content(m.get("content"))} for m in messages]
        try:
            return self._template.render(
                messages=msgs,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                **self.special,
                **(extra or {}),
            )
        except TemplateError:
            raise
        except jinja2.TemplateError as e:
            raise TemplateError(f"chat template failed: {e}") from e

    def chat_ids(self, messages: Sequence[Mapping[str, Any]], **kw: Any) -> list[int]:
        """Prompt ids of a chat: the rendered template encoded without extra special tokens."""
        return self.encode(self.render_chat(messages, **kw), add_special_tokens=False)
