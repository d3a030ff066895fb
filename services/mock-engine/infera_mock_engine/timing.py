"""GPU-like cost of one scheduler step (pure functions, no I/O).

Default curves are NVIDIA Dynamo's mock engine ("mocker") polynomial performance model
(ai-dynamo/dynamo, lib/mocker, `PerfModel::Polynomial`), so simulated TTFT/ITL figures compare
with theirs:

* prefill ms = 4.209989e-07·t² + 1.518344e-02·t + 16.50142, t = new (uncached) prompt tokens
  prefilled in the step's batch; 0 when the step prefills nothing;
* decode ms = −25.74·u² + 54.01·u + 5.74, u = fraction of KV blocks in use, floored at 1 ms;
  0 when no sequence decodes in the step.

Our choice (documented in README.md): a step that both prefills and decodes costs the sum of the
two; every time is divided by the speedup ratio. ``step_start`` places each step on the clock.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TimingModel:
    prefill_a: float = 4.209989e-07
    prefill_b: float = 1.518344e-02
    prefill_c: float = 16.50142
    decode_a: float = -25.74
    decode_b: float = 54.01
    decode_c: float = 5.74
    decode_floor_ms: float = 1.0
    speedup: float = 1.0

    def __post_init__(self) -> None:
        if not self.speedup > 0:
            raise ValueError(f"speedup must be > 0, got {self.speedup}")

    def prefill_ms(self, new_tokens: int) -> float:
        """Model time of prefilling `new_tokens` uncached prompt tokens in one batch."""
        if new_tokens <= 0:
            return 0.0
        t = float(new_tokens)
        return max(0.0, self.prefill_a * t * t + self.prefill_b * t + self.prefill_c)

    def decode_ms(self, kv_usage: float) -> float:
        """Model time of one decode step at KV usage fraction `kv_usage` (clamped to [0, 1])."""
        u = min(1.0, max(0.0, kv_usage))
        return max(self.decode_floor_ms, self.decode_a * u * u + self.decode_b * u + self.decode_c)

    def step_ms(self, prefill_tokens: int, decoding: int, kv_usage: float) -> float:
        """Unscaled model time of a step prefilling `prefill_tokens` and decoding `decoding` sequences."""
        total = self.prefill_ms(prefill_tokens)
        if decoding > 0:
            total += self.decode_ms(kv_usage)
        return total

    def step_seconds(self, prefill_tokens: int, decoding: int, kv_usage: float) -> float:
        """Wall-clock seconds the step takes: model time divided by the speedup ratio."""
        return self.step_ms(prefill_tokens, decoding, kv_usage) / 1000.0 / self.speedup


def step_start(now: float, due: float | None, last: float, overlap: bool, arrived: float = float("-inf")) -> float:
    """When a step begins on the clock, given that the host got to it at ``now``, the step before
    (``last`` seconds long) was due to end at ``due`` (None: the engine was idle in between) and
    the latest request came in at ``arrived``.

    Without overlap a step begins when the host gets to it, so the host's lateness (a busy CPU, a
    slow wake-up, the engine's own HTTP and tokenizer work) lengthens every step. With SGLang's
    overlap schedule (its default) the host prepares the next batch while the GPU runs the current
    one: lateness up to one step's length costs the GPU nothing, and the step begins when the one
    before was due to end; beyond that only the excess is lost. Never before the latest arrival: a
    batch cannot have started before a request in it came in."""
    if not overlap or due is None:
        return now
    return min(now, max(due, now - last, arrived))
