"""Per-DP-rank sequence bookkeeping for the KV-event relay: pure, no I/O.

The engine numbers its batches 0, 1, 2, ... per publisher. The relay forwards each seq once and in
order: a seq at or below the last relayed is a duplicate (e.g. seen both by replay and by the SUB
socket); a seq above last+1 reveals a gap that is filled from the replay socket before the batch
that revealed it is relayed.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Verdict(StrEnum):
    NEXT = "next"  # relay it
    DUPLICATE = "duplicate"  # already relayed: drop
    GAP = "gap"  # seqs are missing before it: fill, then relay it


@dataclass(slots=True)
class SeqTracker:
    last: int = -1  # the last seq relayed (-1: none yet; the engine starts at 0)

    def check(self, seq: int) -> Verdict:
        if seq <= self.last:
            return Verdict.DUPLICATE
        return Verdict.NEXT if seq == self.last + 1 else Verdict.GAP

    def missing(self, seq: int) -> range:
        """The seqs missing before ``seq``."""
        return range(self.last + 1, seq)

    def relayed(self, seq: int) -> None:
        self.last = max(self.last, seq)


def fill_plan(missing: range, replayed: dict[int, bytes]) -> tuple[list[tuple[int, bytes]], list[int]]:
    """What to relay (in seq order) from a replay answer for ``missing``, and what stays lost."""
    found = [(seq, replayed[seq]) for seq in missing if seq in replayed]
    lost = [seq for seq in missing if seq not in replayed]
    return found, lost
