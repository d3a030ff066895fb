"""Which placed requests have gone silent, and whose sender has left the bus. Pure: no I/O.

A request's frames come from one sender: its worker-agent, or on ``--request-transport http`` the
router that calls the engine. If that process dies (SIGKILL, OOM, a crash), nothing tells the
frontend until the worker's discovery record ages out (``--discovery-ttl``, 6 s by default) and its router
says so, or, for a router on http, until ``--upstream-timeout`` (60 s). The broker knows at once:
the dead process's subscriptions are gone, so a question to it gets "no responders".

``Relay`` asks the sender of every request that has received nothing for a while the same
``FramesQuery`` it asks after a reconnect. This class decides:

- ``silent(key, progress, now)``: whether a request has made no progress (frames received) for
  ``silent_after`` seconds, or for ``unheard_after`` seconds when it has received nothing at all;
- ``absent(sender, now)`` / ``present(sender)``: the sender answered "no responders" / answered
  (or timed out: subscribed but busy);
- ``gone(sender, progress, now)``: whether a request of an absent sender ends now. One that has
  received frames waits until its sender has been absent for ``gone_after`` seconds: a process
  reconnecting to the broker is absent for a moment, and its stream would go on after it. One
  that has received nothing ends at the first "no responders": nothing of it reached the client, so
  trying it on another worker costs the client nothing even if its sender comes back (the sender
  would then run it for nobody); the churn bench found such requests waiting 5-6 s before.
  Within ``gone_after`` seconds of this frontend's own reconnect (``reset``), when every sender is
  reconnecting too, the longer rule holds for all.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

from infera_common.absence import Absences


class SenderWatch:
    __slots__ = ("silent_after", "unheard_after", "gone_after", "_progress", "_absent", "_settled_at")

    def __init__(self, silent_after: float, gone_after: float, unheard_after: float | None = None) -> None:
        self.silent_after = silent_after
        self.unheard_after = silent_after if unheard_after is None else unheard_after
        self.gone_after = gone_after
        self._progress: dict[Hashable, tuple[int, float]] = {}  # request -> (frames received, since when)
        self._absent = Absences(gone_after)  # senders answering "no responders"
        self._settled_at = float("-inf")  # before this, every sender may still be reconnecting

    def silent(self, key: Hashable, progress: int, now: float) -> bool:
        """Whether the request ``key``, with ``progress`` frames received so far, has received none
        for its threshold (it counts from the first call that saw this progress)."""
        seen = self._progress.get(key)
        if seen is None or seen[0] != progress:
            self._progress[key] = (progress, now)
            return False
        return now - seen[1] >= (self.unheard_after if progress == 0 else self.silent_after)

    def forget_except(self, keys: Iterable[Hashable]) -> None:
        """Drop the requests not in ``keys`` (they ended)."""
        keep = set(keys)
        for key in [k for k in self._progress if k not in keep]:
            del self._progress[key]

    def absent(self, sender: Hashable, now: float) -> float:
        """The sender answered "no responders": for how many seconds it has done so in a row."""
        return self._absent.absent(sender, now)

    def present(self, sender: Hashable) -> None:
        self._absent.present(sender)

    def gone(self, sender: Hashable, progress: int, now: float) -> bool:
        """Whether a request of ``sender`` with ``progress`` frames received ends now (see the module doc)."""
        if self._absent.since(sender) is None:
            return False
        return (progress == 0 and now >= self._settled_at) or self._absent.gone(sender, now)

    def reset(self, now: float) -> None:
        """This frontend is back on the broker at ``now``: what it saw before means nothing, and the
        senders get ``gone_after`` seconds to be back too."""
        self._progress.clear()
        self._absent.clear()
        self._settled_at = now + self.gone_after
