"""Log probabilities as the engines return them when asked (pure, no I/O).

The mock has no model, so the values are made up, but deterministically: a token's logprob depends
only on the token and its place in the output, so the same seed gives the same logprobs. The
sampled token is reported as the most likely one, and its ``k`` alternatives (other ids of the
vocabulary) as less likely, in order.

Two shapes, as vLLM and SGLang serve them:
- chat (``logprobs: true``, ``top_logprobs: k``): ``{"content": [{"token", "logprob", "bytes",
  "top_logprobs": [{"token", "logprob", "bytes"}, ...k]}, ...]}``;
- completions (``logprobs: k``): ``{"text_offset", "token_logprobs", "tokens", "top_logprobs"}``,
  four parallel lists, ``top_logprobs`` holding ``{token: logprob}`` with the sampled token and its
  ``k`` alternatives; with ``echo`` the prompt's tokens come first, the very first without a
  logprob (``None``), as vLLM gives them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

#: vLLM's default --max-logprobs: more alternatives than this are refused.
MAX_LOGPROBS = 20

Piece = Callable[[int], str]


def token_logprob(token_id: int, position: int) -> float:
    """The made-up logprob of ``token_id`` sampled at ``position``: in [-4.0, -0.001]."""
    h = (token_id * 2654435761 + position * 40503 + 12345) % 4000
    return -round((h + 1) / 1000, 3)


def alternatives(token_id: int, position: int, k: int, vocab_size: int) -> list[tuple[int, float]]:
    """``k`` other tokens, each less likely than the sampled one and than the one before."""
    lp = token_logprob(token_id, position)
    return [((token_id + 7919 * j) % vocab_size, round(lp - 0.5 * j, 3)) for j in range(1, k + 1)]


class LogprobBuilder:
    """The logprobs of one choice, part by part (a stream's chunks) or all at once."""

    def __init__(self, chat: bool, k: int, piece: Piece, vocab_size: int) -> None:
        self.chat = chat
        self.k = k
        self._piece = piece
        self._vocab = vocab_size
        self._position = 0  # of the next generated token
        self._offset = 0  # text offset of the next token (completions)

    def prompt(self, prompt_ids: Sequence[int], piece: Piece) -> dict[str, Any]:
        """Completions with ``echo``: the prompt's tokens (``piece``: one token's text, any token of
        the tokenizer's), the first without a logprob."""
        out = self._columns()
        for i, tid in enumerate(prompt_ids):
            self._add_column(out, tid, -i, piece, first=i == 0)
        return out

    def part(self, token_ids: Sequence[int]) -> dict[str, Any]:
        """The logprobs of the next generated tokens."""
        if self.chat:
            content = [self._chat_entry(tid, self._position + i) for i, tid in enumerate(token_ids)]
            self._position += len(token_ids)
            return {"content": content}
        out = self._columns()
        for tid in token_ids:
            self._add_column(out, tid, self._position, self._piece)
            self._position += 1
        return out

    def _chat_entry(self, tid: int, position: int) -> dict[str, Any]:
        """One token: itself and its ``k`` most likely (itself first, then ``k`` - 1 alternatives)."""
        lp = token_logprob(tid, position)
        text = self._piece(tid)
        tops = [(text, lp)] + [(self._piece(alt), alp) for alt, alp in alternatives(tid, position, self.k - 1,
                                                                                   self._vocab)]
        return {"token": text, "logprob": lp, "bytes": list(text.encode()),
                "top_logprobs": [{"token": t, "logprob": p, "bytes": list(t.encode())} for t, p in tops[: self.k]]}

    @staticmethod
    def _columns() -> dict[str, list[Any]]:
        return {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}

    def _add_column(self, out: dict[str, list[Any]], tid: int, position: int, piece: Piece,
                    first: bool = False) -> None:
        """One token of the completions shape: the sampled one first in its ``top_logprobs``, then its
        ``k`` alternatives (a prompt's first token has no logprob)."""
        text = piece(tid)
        out["tokens"].append(text)
        out["text_offset"].append(self._offset)
        self._offset += len(text)
        if first:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            return
        lp = token_logprob(tid, position)
        top = {text: lp}
        for alt, alp in alternatives(tid, position, self.k, self._vocab):
            top.setdefault(piece(alt), alp)
        out["token_logprobs"].append(lp)
        out["top_logprobs"].append(top)

    @staticmethod
    def join(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
        """Two parts of the same shape as one."""
        return {key: first[key] + then[key] for key in first}
