"""Per-worker circuit breaker. Pure, no I/O, time passed in.

Breaker states per worker key (any hashable: a worker id, or ``(worker_id, dp_rank)``):

``closed``
    normal. ``failure_threshold`` consecutive faults open it; a success resets the count. An
    ``unreachable`` outcome (the engine refused the connection: nothing listens there) opens it at
    once.
``open``
    excluded from routing for the current cooldown (``cooldown_s`` at the first trip).
``half_open``
    the cooldown is over: exactly one request at a time may go there as the probe. The probe's
    success closes the breaker (and resets the cooldown); its fault re-opens it with the
    cooldown doubled, up to ``max_cooldown_s``. A probe that ends neither way (a 4xx, a 429, a
    client cancel) frees the probe slot for the next request.

The caller classifies each outcome (the router: ``core.BREAKER_OUTCOMES`` from the release
outcome): client errors (4xx) and 429 are never faults. Use per request::

    allowed = breaker.filter(candidates, now)        # allowed.all_open: routed anyway, count it
    ticket = breaker.begin(key_of_chosen, now)       # when the request is sent
    change = breaker.record(ticket, outcome, now)    # once, when it ends; a Transition or None

Retrying a failed request on another worker is the frontend's (``infera_frontend.failover``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Generic, TypeVar

DEFAULT_FAILURE_THRESHOLD = 3
DEFAULT_COOLDOWN_S = 5.0
DEFAULT_MAX_COOLDOWN_S = 60.0
#: A probe not recorded after this long is presumed lost: its slot is given to a new probe.
DEFAULT_PROBE_TIMEOUT_S = 300.0

K = TypeVar("K", bound=Hashable)
C = TypeVar("C")


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class Outcome(StrEnum):
    """What one finished request says about its worker's health."""

    SUCCESS = "success"  # the worker served it: resets the fault count, closes a half-open breaker
    FAULT = "fault"  # the worker failed: counts towards opening the breaker
    UNREACHABLE = "unreachable"  # a fault that needs no second: its engine refused the connection
    NEUTRAL = "neutral"  # says nothing about the worker (4xx, 429, client cancel)


class Transition(StrEnum):
    TRIPPED = "tripped"  # closed -> open
    REOPENED = "reopened"  # half-open probe failed -> open, longer cooldown
    CLOSED = "closed"  # half-open probe succeeded -> closed


@dataclass(slots=True, frozen=True)
class Ticket(Generic[K]):
    """One request sent to a worker; ``probe`` > 0 when it is that worker's half-open probe."""

    key: K
    probe: int = 0


@dataclass(slots=True, frozen=True)
class Allowed(Generic[C]):
    candidates: list[C]  # the candidates to route among
    all_open: bool  # every candidate's breaker was open: all are returned, route anyway


@dataclass(slots=True, frozen=True)
class WorkerBreaker:
    """One worker's breaker, for metrics and /debug."""

    state: BreakerState
    consecutive_faults: int
    trips: int  # times it opened (trips and re-opens), since it was first seen
    cooldown_s: float  # the current (or next) cooldown
    open_until: float | None  # when the current cooldown ends (None when closed)


@dataclass(slots=True)
class _Worker:
    faults: int = 0
    open: bool = False
    cooldown: float = 0.0
    open_until: float = 0.0
    trips: int = 0
    probe: int = 0  # the probe in flight (0: none)
    probe_started: float = 0.0


class CircuitBreaker(Generic[K]):
    """Per-worker circuit breakers. Unknown keys are closed; :meth:`forget` a worker that left."""

    def __init__(self, failure_threshold: int = DEFAULT_FAILURE_THRESHOLD,
                 cooldown_s: float = DEFAULT_COOLDOWN_S, max_cooldown_s: float = DEFAULT_MAX_COOLDOWN_S,
                 probe_timeout_s: float = DEFAULT_PROBE_TIMEOUT_S) -> None:
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be at least 1, not {failure_threshold}")
        if cooldown_s <= 0:
            raise ValueError(f"cooldown_s must be positive, not {cooldown_s}")
        if max_cooldown_s < cooldown_s:
            raise ValueError(f"max_cooldown_s ({max_cooldown_s}) must be at least cooldown_s ({cooldown_s})")
        if probe_timeout_s <= 0:
            raise ValueError(f"probe_timeout_s must be positive, not {probe_timeout_s}")
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self.max_cooldown_s = max_cooldown_s
        self.probe_timeout_s = probe_timeout_s
        self._workers: dict[K, _Worker] = {}
        self._next_probe = 0

    def state(self, key: K, now: float) -> BreakerState:
        w = self._workers.get(key)
        if w is None or not w.open:
            return BreakerState.CLOSED
        return BreakerState.OPEN if now < w.open_until else BreakerState.HALF_OPEN

    def allows(self, key: K, now: float) -> bool:
        """Whether a request may go to ``key`` now: closed, or half-open with no probe running."""
        w = self._workers.get(key)
        if w is None or not w.open:
            return True
        return now >= w.open_until and not self._probe_running(w, now)

    def filter(self, candidates: Iterable[C], now: float, key: Callable[[C], K] | None = None) -> Allowed[C]:
        """The candidates a request may go to (order kept). If there are candidates but none is
        allowed, all of them are returned with ``all_open=True``: route anyway."""
        candidates = list(candidates)
        if not any(w.open for w in self._workers.values()):  # none open (the usual case): no check per candidate
            return Allowed(candidates, False)
        allowed = [c for c in candidates if self.allows(key(c) if key else c, now)]  # type: ignore[arg-type]
        if candidates and not allowed:
            return Allowed(candidates, True)
        return Allowed(allowed, False)

    def begin(self, key: K, now: float) -> Ticket[K]:
        """A request is being sent to ``key``. If the worker is half-open and its probe slot is
        free, this request becomes the probe. Pass the ticket to :meth:`record` when it ends."""
        w = self._workers.get(key)
        if w is None or not w.open or now < w.open_until or self._probe_running(w, now):
            return Ticket(key)
        self._next_probe += 1
        w.probe, w.probe_started = self._next_probe, now
        return Ticket(key, self._next_probe)

    def record(self, ticket: Ticket[K] | K, outcome: Outcome | str, now: float) -> Transition | None:
        """A request to the ticket's worker ended with ``outcome``; returns the state change.

        While closed: a fault counts (the threshold-th consecutive one trips the breaker), a
        success resets the count. While open or half-open only the probe's outcome matters;
        outcomes of other requests (sent before the trip, or routed anyway) are ignored.
        A bare key may be passed instead of a ticket for a request that was not a probe.
        """
        if not isinstance(ticket, Ticket):
            ticket = Ticket(ticket)
        outcome = Outcome(outcome)
        key = ticket.key
        w = self._workers.get(key)
        fault = outcome is Outcome.FAULT or outcome is Outcome.UNREACHABLE
        if w is None:
            if not fault:
                return None
            w = self._workers[key] = _Worker(cooldown=self.cooldown_s)
        if not w.open:
            if outcome is Outcome.SUCCESS:
                w.faults = 0
            elif fault:
                w.faults += 1
                if w.faults >= self.failure_threshold or outcome is Outcome.UNREACHABLE:
                    self._open(w, self.cooldown_s, now)
                    return Transition.TRIPPED
            return None
        if ticket.probe == 0 or ticket.probe != w.probe:
            return None
        w.probe = 0
        if outcome is Outcome.SUCCESS:
            w.open, w.faults, w.cooldown = False, 0, self.cooldown_s
            return Transition.CLOSED
        if fault:
            self._open(w, min(w.cooldown * 2, self.max_cooldown_s), now)
            return Transition.REOPENED
        return None

    def forget(self, key: K) -> None:
        """Drop a worker's breaker (it left the fleet)."""
        self._workers.pop(key, None)

    def snapshot(self, now: float) -> dict[K, WorkerBreaker]:
        """Every known worker's breaker (workers never faulted are absent: closed, no trips)."""
        return {
            key: WorkerBreaker(self.state(key, now), w.faults, w.trips, w.cooldown,
                               w.open_until if w.open else None)
            for key, w in self._workers.items()
        }

    def _probe_running(self, w: _Worker, now: float) -> bool:
        return w.probe != 0 and now - w.probe_started < self.probe_timeout_s

    def _open(self, w: _Worker, cooldown: float, now: float) -> None:
        w.open, w.faults, w.cooldown, w.open_until, w.probe = True, 0, cooldown, now + cooldown, 0
        w.trips += 1
