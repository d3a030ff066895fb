"""Before routing: is the model served, and which token ids does the prompt become. Pure, no I/O."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from infera_common.fleet import Change
from infera_common.prompts import prompt_count
from infera_common.schemas import Endpoint, WorkerStatus
from infera_common.tokenizer import ChatTemplateError, ChatTokenizer

from infera_frontend.unlisted import UnlistedWorkers, mismatch_message
from infera_frontend.validation import ApiError, Parsed

#: How many models that lost every worker a frontend keeps answering 503 for (not 404: unknown).
SERVED_MODELS_KEPT = 1024

#: Prompts longer than this (characters) are tokenized in a worker thread, off the event loop.
OFFLOAD_CHARS = 8_192


@dataclass(frozen=True, slots=True)
class ContextLimit:
    """The context length a model's workers take, and how they treat ``max_tokens`` past what the
    prompt leaves of it: refused (SGLang: prompt + ``max_tokens`` must fit) or clamped to fit (vLLM,
    which refuses only ``max_tokens`` past the context length itself)."""

    length: int
    clamps: bool = False


class ModelTable:
    """Per model: how many workers serve it, how many are active. Follows discovery changes.

    ``discovery`` describes where this frontend's discovery looks (named in its errors); ``unlisted``
    holds the running workers that discovery does not list (another plane), ``clock`` its time.
    """

    def __init__(self, discovery: str = "", unlisted: UnlistedWorkers | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        # worker_id -> (its served names, active, its (model name, adapter) pairs: SGLang's ``base:adapter``)
        self._workers: dict[str, tuple[tuple[str, ...], bool, tuple[tuple[str, str], ...]]] = {}
        self._pairs: Counter[tuple[str, str]] = Counter()
        # model -> active worker_id -> (context length, whether its engine clamps max_tokens to fit)
        self._lengths: dict[str, dict[str, tuple[int | None, bool]]] = {}
        self._known: Counter[str] = Counter()
        self._active: Counter[str] = Counter()
        # models some worker served since this frontend started, most recent last (bounded): a model
        # whose workers all left is unavailable (503), not unknown (404)
        self._served: dict[str, None] = {}
        self.discovery = discovery
        self.unlisted = unlisted if unlisted is not None else UnlistedWorkers()
        self._clock = clock

    def apply(self, change: Change) -> None:
        rec = change.record
        old = self._workers.pop(rec.worker_id, None)
        if old is not None:
            names, was_active, pairs = old
            self._pairs.subtract(pairs)
            for name in names:
                self._known[name] -= 1
                if was_active:
                    self._active[name] -= 1
                    lengths = self._lengths[name]
                    lengths.pop(rec.worker_id, None)
                    if not lengths:
                        del self._lengths[name]
        if change.kind != "leave":
            active = rec.status == WorkerStatus.ACTIVE
            names = tuple(rec.served_names)  # its model and its aliases: a request may give any of them
            pairs = tuple((base, a) for base in dict.fromkeys([rec.model, *rec.aliases]) for a in rec.adapters
                          if rec.adapter(a) is not None)
            self._workers[rec.worker_id] = (names, active, pairs)
            self._pairs.update(pairs)
            for name in names:
                self._known[name] += 1
                self._served.pop(name, None)
                self._served[name] = None
                if len(self._served) > SERVED_MODELS_KEPT:
                    del self._served[next(iter(self._served))]
                if active:
                    self._active[name] += 1
                    self._lengths.setdefault(name, {})[rec.worker_id] = (rec.context_length, rec.clamps_max_tokens)
            self.unlisted.listed(rec.worker_id)

    def resolve(self, model: str) -> str:
        """The name a request's ``model`` is served under: itself when a registered worker serves that
        name, else the adapter of SGLang's ``<model>:<adapter>`` form (split at the first colon, as SGLang
        does) when a worker serves that model with that adapter."""
        if self._known[model] > 0:
            return model
        base, sep, name = model.partition(":")
        return name if sep and self._pairs[(base, name)] > 0 else model

    def _adapter_hint(self, model: str) -> str:
        """For SGLang's ``<model>:<adapter>`` form naming an adapter with a model that does not serve
        it: the models that do."""
        base, sep, name = model.partition(":")
        bases = sorted({b for (b, a), count in self._pairs.items() if a == name and count > 0}) if sep else []
        if not bases:
            return ""
        return (f" The LoRA adapter `{name}` is served with {', '.join(f'`{b}`' for b in bases)}: give `{name}`"
                f" (or `{bases[0]}:{name}`).")

    def lists(self, worker_id: str) -> bool:
        """Whether discovery lists this worker."""
        return worker_id in self._workers

    def is_known(self, model: str) -> bool:
        """Whether a worker serving ``model`` is registered, or was since this frontend started."""
        return self._known[model] > 0 or model in self._served

    def context_limit(self, model: str) -> ContextLimit | None:
        """What the active workers of ``model`` accept: the longest context length among them, and
        whether one of them clamps ``max_tokens`` to fit (then only ``max_tokens`` past the length is
        refused); None when one of them did not say (it may accept anything) or none is active."""
        limits = self._lengths.get(model)
        if not limits:
            return None
        lengths = [length for length, _ in limits.values()]
        if None in lengths:
            return None
        return ContextLimit(max(lengths), any(clamps for _, clamps in limits.values()))  # type: ignore[type-var]

    def check(self, model: str) -> None:
        """Raise the client's error when ``model`` cannot be served now: 404 unknown, 503 none active
        (or served only by running workers registered in another discovery than this frontend's)."""
        if self._active[model] > 0:
            return
        elsewhere = self.unlisted.current(self._clock(), model)
        if elsewhere:
            raise ApiError(503, mismatch_message(model, elsewhere, self.discovery or "?"),
                           type="service_unavailable_error", code="discovery_mismatch")
        where = f" (discovery: {self.discovery})" if self.discovery else ""
        if self._known[model] <= 0 and model not in self._served:
            registered = f" in {self.discovery}" if self.discovery else ""
            raise ApiError(
                404, f"The model `{model}` does not exist: no worker serving it is registered{registered}."
                + self._adapter_hint(model), type="invalid_request_error", param="model", code="model_not_found",
            )
        if self._known[model] <= 0:
            raise ApiError(503, f"No worker serves the model `{model}` right now: every worker that served it "
                           f"has left{where}; retry shortly.", type="service_unavailable_error")
        raise ApiError(503, f"No active worker serves the model `{model}` right now{where}; retry shortly.",
                       type="service_unavailable_error")


@dataclass(slots=True)
class Tokens:
    """What the router needs of the prompt: its token ids (``None`` if unknown) and their count."""

    token_ids: Sequence[int] | None  # a list, or the validated array of a token-id prompt
    prompt_tokens: int
    ok: bool = True  # False: the engine's token ids could not be reproduced (token invariant)
    longest: int = -1  # the longest prompt's count, for a batch (-1: ``prompt_tokens``, one prompt)

    @property
    def longest_prompt(self) -> int:
        return self.prompt_tokens if self.longest < 0 else self.longest


def samples(parsed: Parsed) -> int:
    """``n``: the samples the engine generates for each of the request's prompts."""
    return parsed.data.get("n") or 1


def sequences(parsed: Parsed) -> int:
    """The sequences the engine will run for the request: ``n`` samples of each of its prompts (a
    completions batch has several)."""
    n = samples(parsed)
    if parsed.endpoint == Endpoint.CHAT or parsed.prompt_ids is not None:
        return n
    return n * prompt_count(parsed.data["prompt"])


def check_sequences(parsed: Parsed, limit: int) -> None:
    """400 when the request asks for more than ``limit`` sequences (``--max-sequences-per-request``)."""
    wanted = sequences(parsed)
    if wanted <= limit:
        return
    n = samples(parsed)
    what = f"n={n}" if wanted == n else f"n={n} for each of {wanted // n} prompts"
    raise ApiError(400, f"This request asks for {wanted} sequences ({what}); this server allows at most {limit} "
                   "per request (--max-sequences-per-request, env INFERA_MAX_SEQUENCES_PER_REQUEST).",
                   type="invalid_request_error", param="n" if wanted == n else "prompt", code="too_many_sequences")


def prompt_chars(parsed: Parsed) -> int:
    """A cheap size of the text to tokenize, to decide whether to leave the event loop."""
    data = parsed.data
    if parsed.endpoint == Endpoint.CHAT:
        n = 0
        for m in data["messages"]:
            c = m.get("content")
            if isinstance(c, str):
                n += len(c)
            elif isinstance(c, list):
                n += sum(len(p.get("text") or "") for p in c if isinstance(p, dict))
        return n
    prompt = data["prompt"]
    if isinstance(prompt, str):
        return len(prompt)
    if not isinstance(prompt[0], str):  # token ids (validated: all ids, or all lists of ids)
        return 0
    return sum(map(len, prompt))  # validated: a list of strings


def longest_prompt_chars(parsed: Parsed) -> int:
    """The characters of the request's longest prompt to tokenize (0 for token ids): a chat's
    messages make one prompt, a completions batch several."""
    prompt = parsed.data.get("prompt")
    if parsed.endpoint == Endpoint.CHAT or isinstance(prompt, str):
        return prompt_chars(parsed)
    if not prompt or not isinstance(prompt[0], str):
        return 0
    return max(map(len, prompt))


def tokenize(tok: ChatTokenizer, parsed: Parsed) -> Tokens:
    """Token ids for routing, as the engine will compute them.

    Chat: the chat template (generation prompt added) then encode without special tokens.
    Completions: a text prompt with the tokenizer's special tokens; token ids used as given. A batch
    prompt (list) is routed by its first prompt and counted in full.
    """
    data = parsed.data
    if parsed.endpoint == Endpoint.CHAT:
        kwargs: Any = data.get("chat_template_kwargs")
        try:
            ids = tok.chat_ids(data["messages"], tools=data.get("tools"),
                               template_kwargs=kwargs if isinstance(kwargs, dict) else None)
        except ChatTemplateError:
            return Tokens(None, 0, ok=False)
        return Tokens(ids, len(ids))
    if parsed.prompt_ids is not None:  # token ids, validated into an array: packed for the bus without a copy
        return Tokens(parsed.prompt_ids, len(parsed.prompt_ids))
    prompt = data["prompt"]
    if isinstance(prompt, str):
        ids = tok.prompt_ids(prompt)
        return Tokens(ids, len(ids))
    batches = [p if isinstance(p, list) else tok.prompt_ids(p) for p in prompt]
    return Tokens(batches[0], sum(len(b) for b in batches), longest=max(len(b) for b in batches))


def check_context(parsed: Parsed, tokens: Tokens, limit: ContextLimit | None) -> None:
    """400 ``context_length_exceeded`` when the request cannot fit the model's context length
    (``limit``: the longest any of its workers takes): a prompt of that many tokens or more leaves no
    room for one output token; a prompt plus the ``max_tokens`` asked must fit, unless the workers
    clamp ``max_tokens`` to what is left (vLLM), when only ``max_tokens`` past the length is refused.
    The engines would refuse the same requests after routing (SGLang's sum check is ``>=``, one token
    stricter: that one it refuses itself); the frontend says it first, the same way for every engine.
    Not checked without a limit, for prompts whose count is not known (token invariant), or when the
    client asks vLLM to cut the prompt down (``truncate_prompt_tokens``)."""
    if tokens.ok:
        _check_length(parsed, tokens.longest_prompt, limit, exact=True)


def check_context_floor(parsed: Parsed, at_least: int, limit: ContextLimit | None) -> None:
    """``check_context`` before tokenizing, with the fewest tokens the longest prompt can become
    (``ChatTokenizer.min_tokens``): a prompt far past the context length is refused at once, not
    after seconds of tokenizing (an 8 MiB prompt held the frontend ~20 s and ~1.2 GB)."""
    _check_length(parsed, at_least, limit, exact=False)


def _check_length(parsed: Parsed, prompt: int, context: ContextLimit | None, exact: bool) -> None:
    data = parsed.data
    if context is None or data.get("truncate_prompt_tokens") is not None:
        return
    limit = context.length
    chat = parsed.endpoint == Endpoint.CHAT
    where = "messages" if chat else "prompt"
    count = f"{prompt}" if exact else f"at least {prompt}"
    if prompt >= limit:
        raise ApiError(400, f"This model's maximum context length is {limit} tokens. However, your {where} "
                       f"resulted in {count} tokens, leaving no room for the completion. Please reduce the "
                       f"length of the {where}.", type="invalid_request_error", param=where,
                       code="context_length_exceeded")
    key = "max_completion_tokens" if chat and data.get("max_completion_tokens") is not None else "max_tokens"
    wanted = data.get(key)
    if wanted is None:
        return
    if context.clamps:
        if wanted > limit:
            raise ApiError(400, f"`{key}` is {wanted}, more than this model's maximum context length of {limit} "
                           f"tokens; the completion is cut to what the {where} leaves of it, but `{key}` itself "
                           f"cannot be greater. Please request fewer output tokens.",
                           type="invalid_request_error", param=key, code="context_length_exceeded")
    elif prompt + wanted > limit:
        total = f"{prompt + wanted}" if exact else f"at least {prompt + wanted}"
        raise ApiError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                       f"{total} tokens ({count} in the {where}, {wanted} in the completion). Please "
                       f"reduce the length of the {where} or `{key}`.", type="invalid_request_error", param=key,
                       code="context_length_exceeded")
