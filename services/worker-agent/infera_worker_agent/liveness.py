"""Whether a serving engine counts as healthy, from its health probes in order. Pure, no I/O.

An engine that stops answering while its process lives on (a wedged scheduler, a hung collective)
is the failure the exit watch cannot see. ``failures`` probes in a row that fail make it
unhealthy; one that passes makes it healthy again. SGLang's /health exercises the engine's real
path: it queues a one-token generation and passes once any output comes back. vLLM's /health only
says whether the engine core process lives, so a hung GPU passes it; ``StallCheck`` says when to
test the engine the way SGLang does (a canary), and a canary that gets nothing back makes the
engine unhealthy at once (``Liveness.stalled``).
"""

from __future__ import annotations


class Liveness:
    __slots__ = ("failures", "healthy", "failed_in_a_row")

    def __init__(self, failures: int) -> None:
        if failures < 1:
            raise ValueError("failures must be at least 1")
        self.failures = failures
        self.healthy = True
        self.failed_in_a_row = 0

    def observe(self, ok: bool) -> bool | None:
        """One probe's outcome; returns the new verdict when it changes (False: unhealthy), else None."""
        if ok:
            self.failed_in_a_row = 0
            if not self.healthy:
                self.healthy = True
                return True
            return None
        self.failed_in_a_row += 1
        if self.healthy and self.failed_in_a_row >= self.failures:
            self.healthy = False
            return False
        return None

    def stalled(self) -> bool | None:
        """A canary got nothing back while the engine held work: unhealthy now (False when that is a
        change, else None); the next probe that passes makes it healthy again."""
        self.failed_in_a_row = max(self.failed_in_a_row, self.failures)
        if self.healthy:
            self.healthy = False
            return False
        return None


class StallCheck:
    """When a health round should send the engine a canary (a one-token completion).

    Each round gives the work the engine holds (its running + waiting requests, or the agent's own
    in flight, whichever is larger) and its progress mark (the token counters summed, ``None`` when
    the engine has none). A canary is due when the engine held work at this round and at the one
    before and the mark did not move between them: a whole round with requests in hand and not one
    token counted. A busy healthy engine moves its counters every round and is never sent one; an
    engine that counts a request's tokens only when it ends (SGLang) is sent one while long requests
    run, which it answers within a step. Without counters no canary is ever due.
    """

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last: tuple[int, float | None] | None = None

    def canary_due(self, work: int, mark: float | None) -> bool:
        last, self._last = self._last, (work, mark)
        if last is None or mark is None or work <= 0:
            return False
        last_work, last_mark = last
        return last_work > 0 and last_mark == mark
