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
        tokens: list[str] = []
        offsets: list[int] = []
        lps: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        for i, tid in enumerate(prompt_ids):
            text = piece(tid)
            tokens.append(text)
            offsets.append(self._offset)
            self._offset += len(text)
            if i == 0:
                lps.append(None)
                tops.append(None)
            else:
                lp = token_logprob(tid, -i)
                lps.append(lp)
                tops.append({text: lp, **{piece(a): alp for a, alp in alternatives(tid, -i, self.k, self._vocab)}})
        return {"text_offset": offsets, "token_logprobs": lps, "tokens": tokens, "top_logprobs": tops}

    def part(self, token_ids: Sequence[int]) -> dict[str, Any]:
        """The logprobs of the next generated tokens."""
        if self.chat:
            content = []
            for tid in token_ids:
                lp = token_logprob(tid, self._position)
                text = self._piece(tid)
                tops = [{"token": text, "logprob": lp, "bytes": list(text.encode())}]
                for alt, alp in alternatives(tid, self._position, self.k, self._vocab)[: max(self.k - 1, 0)]:
                    alt_text = self._piece(alt)
                    tops.append({"token": alt_text, "logprob": alp, "bytes": list(alt_text.encode())})
                content.append({"token": text, "logprob": lp, "bytes": list(text.encode()),
                                "top_logprobs": tops[: self.k]})
                self._position += 1
            return {"content": content}
        out: dict[str, list[Any]] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
        for tid in token_ids:
            lp = token_logprob(tid, self._position)
            text = self._piece(tid)
            out["text_offset"].append(self._offset)
            out["token_logprobs"].append(lp)
            out["tokens"].append(text)
            top = {text: lp}
            for alt, alp in alternatives(tid, self._position, self.k, self._vocab):
                top.setdefault(self._piece(alt), alp)
            out["top_logprobs"].append(top)
            self._offset += len(text)
            self._position += 1
        return out

    @staticmethod
    def join(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
        """Two parts of the same shape as one."""
        return {key: first[key] + then[key] for key in first}
