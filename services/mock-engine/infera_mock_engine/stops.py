"""Incremental stop-string matching over streamed text (pure).

Text that might be the beginning of a stop string is held back until it is known not to be, so
no streamed byte ever has to be taken back; output is cut before the stop string.
"""

from __future__ import annotations

from collections.abc import Iterable


class StopMatcher:
    def __init__(self, stops: Iterable[str]) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""

    def feed(self, piece: str) -> tuple[str, str | None]:
        """Add generated text; returns (text safe to emit now, the stop string matched or None).

        After a match the returned text is everything before the stop string; stop feeding.
        """
        if not self.stops:
            return piece, None
        buf = self._held + piece
        best: tuple[int, str] | None = None
        for stop in self.stops:
            i = buf.find(stop)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, stop)
        if best is not None:
            self._held = ""
            return buf[: best[0]], best[1]
        keep = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(buf)), keep, -1):
                if stop.startswith(buf[-n:]):
                    keep = n
                    break
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], None

    def flush(self) -> str:
        """Text still held back when generation ends without a match."""
        rest, self._held = self._held, ""
        return rest
