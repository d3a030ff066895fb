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

from collections.abc import Mapping
from enum import StrEnum


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


class CanaryReason(StrEnum):
    STALLED = "stalled"  # it held work through a whole round and counted no token
    SUSPECT = "suspect"  # an earlier canary went unanswered: one every round until it makes progress
    IDLE = "idle"  # it held nothing and counted nothing for ``idle_after`` seconds
    RANK = "rank"  # one DP rank held the agent's requests through a whole round and sent no frame


class StallCheck:
    """When a health round should send the engine a canary (a one-token completion), and why.

    Each round gives the work the engine holds (its running + waiting requests, or the agent's own
    in flight, whichever is larger), its progress mark (the token counters summed, ``None`` when
    the engine has none) and the time. A canary is due:

    - ``STALLED``: the engine held work at this round and at the one before and the mark did not
      move between them: a whole round with requests in hand and not one token counted. A busy
      healthy engine moves its counters every round and is never sent one; an engine that counts a
      request's tokens only when it ends (SGLang) is sent one while long requests run, which it
      answers within a step. Without counters this rule never fires.
    - ``SUSPECT``: every round after a canary went unanswered (``canary_done(silent=True)``), until
      a canary passes or the mark moves. The engine stays under test even when what it held is
      gone (handed back, or dropped by an engine that empties its queue on abort), so it does not
      turn healthy again for holding nothing.
    - ``IDLE`` (``idle_after`` > 0): the engine held nothing and its mark did not move for
      ``idle_after`` seconds: a hang is then found before a request meets it, not after.
    """

    __slots__ = ("idle_after", "_last", "_active_at", "suspect")

    def __init__(self, idle_after: float = 0.0) -> None:
        self.idle_after = idle_after
        self._last: tuple[int, float | None] | None = None
        self._active_at: float | None = None  # when it last held work, moved its mark or passed a canary
        self.suspect = False

    def canary_due(self, work: int, mark: float | None, now: float) -> CanaryReason | None:
        last, self._last = self._last, (work, mark)
        moved = last is not None and mark is not None and last[1] != mark
        if self._active_at is None or work > 0 or moved:
            self._active_at = now
        if self.suspect:
            if not moved:
                return CanaryReason.SUSPECT
            self.suspect = False  # tokens counted since the last round: it works again
        if last is None:
            return None
        if mark is not None and work > 0 and last[0] > 0 and not moved:
            return CanaryReason.STALLED
        if self.idle_after > 0 and work <= 0 and now - self._active_at >= self.idle_after:
            return CanaryReason.IDLE
        return None

    def canary_done(self, silent: bool, now: float) -> None:
        """A canary's verdict: unanswered (``silent``) keeps the engine under test every round."""
        self.suspect = silent
        if not silent:
            self._active_at = now


class RankStallCheck:
    """When a health round should send a canary pinned to one DP rank, and to which.

    With plain data parallelism (SGLang ``--dp`` without DP attention, vLLM's for a dense model)
    each rank is its own scheduler on its own GPU: one that hangs leaves the others counting
    tokens, so ``StallCheck`` never fires, and a /health that generates lands on any rank. The
    agent knows the rank the router pinned each request to. Each round gives, per rank, the
    requests in flight there and the frames they have sent so far (the mark). A rank is due when
    it held requests at this round and at the one before and its mark did not move between them:
    a whole round in which not one of its requests got a token, a head or an answer. After a
    canary to it went unanswered, that rank is due every round until one passes or its mark
    moves (requests handed back leave it under test, as ``StallCheck.suspect`` does).
    """

    __slots__ = ("_last", "suspect")

    def __init__(self) -> None:
        self._last: dict[int, tuple[int, int]] = {}
        self.suspect: int | None = None

    def rank_due(self, ranks: Mapping[int, tuple[int, int]]) -> int | None:
        last, self._last = self._last, dict(ranks)
        if self.suspect is not None:
            now, before = ranks.get(self.suspect), last.get(self.suspect)
            if now is None or before is None or now[1] == before[1]:
                return self.suspect
            self.suspect = None  # its requests got frames since the last round: it works again
        for rank in sorted(ranks):
            work, mark = ranks[rank]
            before = last.get(rank)
            if before is not None and work > 0 and before[0] > 0 and before[1] == mark:
                return rank
        return None

    def canary_done(self, rank: int, silent: bool) -> None:
        self.suspect = rank if silent else None
