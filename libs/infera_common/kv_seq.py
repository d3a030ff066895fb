"""Per-DP-rank sequence bookkeeping for a ZMQ KV-event reader: pure, no I/O.

The engine numbers its batches 0, 1, 2, ... per publisher. A reader hands each seq on once and in
order: a seq at or below the last handled is normally a duplicate (seen both by replay and by the
SUB socket); a seq above last+1 reveals a gap, filled from the replay socket before the batch that
revealed it is handed on.

An engine that restarts behind the same endpoint numbers from 0 again, so its first batches also
arrive "at or below the last handled". ``RankSeq`` with ``detect_restarts`` tells the two apart by
content: a duplicate carries the very bytes handled under that seq (kept as digests for the last
``window`` seqs); other bytes, or a seq older than the window, mean a new engine (``RESTART``).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from enum import StrEnum

#: How many recent batches a restart-detecting ``RankSeq`` remembers (digests only).
RECENT_WINDOW = 4096


class Verdict(StrEnum):
    NEXT = "next"  # hand it on
    DUPLICATE = "duplicate"  # already handled: drop
    GAP = "gap"  # seqs are missing before it: fill, then hand it on
    RESTART = "restart"  # the engine restarted (seq went backwards with other content): start over


@dataclass(slots=True)
class SeqTracker:
    last: int = -1  # the last seq handled (-1: none yet; the engine starts at 0)

    def check(self, seq: int) -> Verdict:
        if seq <= self.last:
            return Verdict.DUPLICATE
        return Verdict.NEXT if seq == self.last + 1 else Verdict.GAP

    def missing(self, seq: int) -> range:
        """The seqs missing before ``seq``."""
        return range(self.last + 1, seq)

    def relayed(self, seq: int) -> None:
        self.last = max(self.last, seq)

    def reset(self) -> None:
        self.last = -1


def fill_plan(missing: range, replayed: dict[int, bytes]) -> tuple[list[tuple[int, bytes]], list[int]]:
    """What to hand on (in seq order) from a replay answer for ``missing``, and what stays lost."""
    found = [(seq, replayed[seq]) for seq in missing if seq in replayed]
    lost = [seq for seq in missing if seq not in replayed]
    return found, lost


class RankSeq:
    """One rank's ordering state: the ``SeqTracker``, plus (with ``detect_restarts``) the digests of
    recent batches that tell a repeated batch from a restarted engine's new one."""

    __slots__ = ("tracker", "detect_restarts", "window", "_recent")

    def __init__(self, detect_restarts: bool = False, window: int = RECENT_WINDOW) -> None:
        self.tracker = SeqTracker()
        self.detect_restarts = detect_restarts
        self.window = window
        self._recent: OrderedDict[int, int] = OrderedDict()  # seq -> digest of its payload, oldest first

    @property
    def last(self) -> int:
        return self.tracker.last

    def verdict(self, seq: int, payload: bytes) -> Verdict:
        verdict = self.tracker.check(seq)
        if verdict is not Verdict.DUPLICATE or not self.detect_restarts:
            return verdict
        return Verdict.DUPLICATE if self._recent.get(seq) == hash(payload) else Verdict.RESTART

    def missing(self, seq: int) -> range:
        return self.tracker.missing(seq)

    def handled(self, seq: int, payload: bytes) -> None:
        self.tracker.relayed(seq)
        if self.detect_restarts:
            recent = self._recent
            recent[seq] = hash(payload)
            while len(recent) > self.window:
                recent.popitem(last=False)

    def restart(self) -> None:
        """Forget everything: the next batch is judged as a new engine's."""
        self.tracker.reset()
        self._recent.clear()
