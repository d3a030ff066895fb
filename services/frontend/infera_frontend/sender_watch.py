"""Which placed requests have gone silent, and whose sender has left the bus. Pure: no I/O.

A request's frames come from one sender: its worker-agent, or on ``--request-transport http`` the
router that calls the engine. If that process dies (SIGKILL, OOM, a crash), nothing tells the
frontend until the worker's discovery record ages out (``--discovery-ttl``, 6 s by default) and its router
says so, or, for a router on http, until ``--upstream-timeout`` (60 s). The broker knows at once:
the dead process's subscriptions are gone, so a question to it gets "no responders".

``Relay`` asks the sender of every request that has received nothing for ``silent_after``
seconds the same ``FramesQuery`` it asks after a reconnect. This class decides:

- ``silent(key, progress, now)``: whether a request has made no progress (frames received) for
  ``silent_after`` seconds;
- ``absent(sender, now)`` / ``present(sender)``: whether a sender has answered "no responders" on
  every question for at least ``gone_after`` seconds (a process reconnecting to the broker is
  absent for a moment: one "no responders" is not enough). An answer, or a timeout (a sender that
  is subscribed but busy), makes it present again.
- ``reset()``: after this frontend's own reconnect, what it saw before means nothing.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable


class SenderWatch:
    __slots__ = ("silent_after", "gone_after", "_progress", "_absent_since")

    def __init__(self, silent_after: float, gone_after: float) -> None:
        self.silent_after = silent_after
        self.gone_after = gone_after
        self._progress: dict[Hashable, tuple[int, float]] = {}  # request -> (frames received, since when)
        self._absent_since: dict[Hashable, float] = {}  # sender -> first "no responders" in a row

    def silent(self, key: Hashable, progress: int, now: float) -> bool:
        """Whether the request ``key``, with ``progress`` frames received so far, has received none
        for ``silent_after`` seconds (it counts from the first call that saw this progress)."""
        seen = self._progress.get(key)
        if seen is None or seen[0] != progress:
            self._progress[key] = (progress, now)
            return False
        return now - seen[1] >= self.silent_after

    def forget_except(self, keys: Iterable[Hashable]) -> None:
        """Drop the requests not in ``keys`` (they ended)."""
        keep = set(keys)
        for key in [k for k in self._progress if k not in keep]:
            del self._progress[key]

    def absent(self, sender: Hashable, now: float) -> bool:
        """The sender answered "no responders": whether it has done so for ``gone_after`` seconds."""
        since = self._absent_since.setdefault(sender, now)
        return now - since >= self.gone_after

    def present(self, sender: Hashable) -> None:
        self._absent_since.pop(sender, None)

    def reset(self) -> None:
        self._progress.clear()
        self._absent_since.clear()
