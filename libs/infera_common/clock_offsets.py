"""How far each peer's wall clock is from this process's, from the time it says it is. Pure: no I/O.

A route request carries its frontend's ``route_deadline`` on the frontend's wall clock. A router on
a host whose clock is ahead by more than ``--route-timeout`` (5 s: a host without time sync, a VM
resumed from a snapshot) found every request of that frontend already expired and answered 504 to
all of them. So the router compares a deadline with its own clock only once it knows the offset
between the two: it asks the frontend the time (the frontend's ``alive`` subject answers with its
wall clock, ``time_answer``), as NTP does. With ``sent`` and ``received`` on the asker's clock and
``their_time`` the answer, the offset (asker minus peer) is ``(sent + received) / 2 - their_time``,
wrong by at most half the round trip. Of the last ``KEEP`` samples the one with the shortest round
trip counts; a sample whose round trip took longer than ``max_round_trip`` says too little and is
dropped, and one that cannot agree with the estimate (further from it than both samples' error
bounds and ``STEP_TOLERANCE`` allow) says a clock stepped, and starts the samples over. A peer's offset is asked again ``resync_after`` seconds after the last question, when it
is needed (``due``): the clocks drift slowly, and a peer nobody needs is not asked.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable
from dataclasses import dataclass, field

KEEP = 4
RESYNC_AFTER = 30.0
MAX_ROUND_TRIP = 1.0
MAX_PEERS = 4096
STEP_TOLERANCE = 0.05


def time_answer(now: float) -> bytes:
    """The answer to "what time is it": the wall clock in seconds, as text."""
    return b"%.6f" % now


def read_time_answer(data: bytes) -> float | None:
    """The time in a ``time_answer``; None for an empty answer (a peer that predates the question)
    or one that is not a time."""
    try:
        value = float(data) if data else None
    except ValueError:
        return None
    return value if value is not None and value == value and abs(value) != float("inf") else None


@dataclass(slots=True)
class _Peer:
    samples: deque = field(default_factory=lambda: deque(maxlen=KEEP))  # (round trip, offset)
    asked: float | None = None  # monotonic time of the last question


class ClockOffsets:
    __slots__ = ("resync_after", "max_round_trip", "max_peers", "_peers")

    def __init__(self, resync_after: float = RESYNC_AFTER, max_round_trip: float = MAX_ROUND_TRIP,
                 max_peers: int = MAX_PEERS) -> None:
        self.resync_after = resync_after
        self.max_round_trip = max_round_trip
        self.max_peers = max_peers
        self._peers: OrderedDict[Hashable, _Peer] = OrderedDict()  # least recently needed first

    def offset(self, key: Hashable) -> float | None:
        """Seconds this clock is ahead of ``key``'s (negative: behind); None while not known."""
        peer = self._peers.get(key)
        if peer is None or not peer.samples:
            return None
        return min(peer.samples)[1]

    def due(self, key: Hashable, now: float) -> bool:
        """``key`` is needed at ``now`` (monotonic): whether to ask it the time now. True at first
        sight and ``resync_after`` seconds after the last question; the caller then asks and says
        ``asked``."""
        peer = self._peers.get(key)
        if peer is None:
            peer = self._peers[key] = _Peer()
            while len(self._peers) > self.max_peers:
                self._peers.popitem(last=False)
        else:
            self._peers.move_to_end(key)
        return peer.asked is None or now - peer.asked >= self.resync_after

    def asked(self, key: Hashable, now: float) -> None:
        peer = self._peers.get(key)
        if peer is not None:
            peer.asked = now

    def observe(self, key: Hashable, sent: float, their_time: float, received: float) -> float | None:
        """One answer: asked at ``sent``, answered ``their_time``, received at ``received`` (this
        process's wall clock). The offset it gives, or None when it is dropped."""
        peer = self._peers.get(key)
        round_trip = received - sent
        if peer is None or not 0 <= round_trip <= self.max_round_trip:
            return None
        offset = (sent + received) / 2 - their_time
        if peer.samples:
            best_round_trip, best = min(peer.samples)
            if abs(offset - best) > (round_trip + best_round_trip) / 2 + STEP_TOLERANCE:
                peer.samples.clear()  # a clock stepped: what came before no longer holds
        peer.samples.append((round_trip, offset))
        return offset

    def largest(self) -> float:
        """The offset farthest from zero, in absolute seconds (0 while none is known)."""
        offsets = [abs(min(p.samples)[1]) for p in self._peers.values() if p.samples]
        return max(offsets, default=0.0)

    def forget(self, key: Hashable) -> None:
        self._peers.pop(key, None)

    def __len__(self) -> int:
        return len(self._peers)
