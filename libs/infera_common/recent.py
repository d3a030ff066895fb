"""Recently seen ids with a time-to-live and a size bound: pure, the clock is passed in.

A request runner remembers cancelled request ids, so that an envelope arriving after its cancel is
dropped instead of run, and how many frames each finished request sent (``get``), for a requester
that asks after a broker outage.
"""

from __future__ import annotations

from collections import OrderedDict


class RecentIds:
    def __init__(self, ttl: float = 60.0, max_size: int = 10_000) -> None:
        self._ttl = ttl
        self._max_size = max_size
        self._seen: OrderedDict[str, tuple[float, object]] = OrderedDict()  # id -> (time added, value), oldest first

    def add(self, key: str, now: float, value: object = None) -> None:
        self._seen.pop(key, None)
        self._seen[key] = (now, value)
        self._prune(now)

    def contains(self, key: str, now: float) -> bool:
        self._prune(now)
        return key in self._seen

    def get(self, key: str, now: float) -> object:
        """The value added with ``key``; None when it was not added or has been forgotten."""
        self._prune(now)
        entry = self._seen.get(key)
        return None if entry is None else entry[1]

    def __len__(self) -> int:
        return len(self._seen)

    def _prune(self, now: float) -> None:
        while self._seen:
            key, (added, _) = next(iter(self._seen.items()))
            if now - added < self._ttl and len(self._seen) <= self._max_size:
                break
            del self._seen[key]
