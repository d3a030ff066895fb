"""How long a party has been away from the bus, from its "no responders" answers. Pure: no I/O.

A process that died has no subscriptions, so a question to it gets "no responders" at once; so does
one reconnecting to the broker, for a moment. ``absent(key, now)`` records one such answer and says
how long they have come in a row; ``present(key)`` (an answer, or a timeout: subscribed but busy)
starts over; ``gone(key, now)`` says whether they have come for ``gone_after`` seconds.
"""

from __future__ import annotations

from collections.abc import Hashable


class Absences:
    __slots__ = ("gone_after", "_since")

    def __init__(self, gone_after: float) -> None:
        self.gone_after = gone_after
        self._since: dict[Hashable, float] = {}  # key -> its first "no responders" in a row

    def absent(self, key: Hashable, now: float) -> float:
        """``key`` answered "no responders": for how many seconds it has done so in a row."""
        return now - self._since.setdefault(key, now)

    def since(self, key: Hashable) -> float | None:
        """When ``key``'s current run of "no responders" began (None: it is not absent)."""
        return self._since.get(key)

    def present(self, key: Hashable) -> None:
        self._since.pop(key, None)

    def gone(self, key: Hashable, now: float) -> bool:
        since = self._since.get(key)
        return since is not None and now - since >= self.gone_after

    def forget_except(self, keys: set) -> None:
        for key in [k for k in self._since if k not in keys]:
            del self._since[key]

    def clear(self) -> None:
        self._since.clear()
