"""Per-worker circuit breaker and the failover retry rule. Pure, no I/O, time passed in.

Breaker states per worker key (any hashable: a worker id, or ``(worker_id, dp_rank)``):

``closed``
    normal. ``failure_threshold`` consecutive faults open it; a success resets the count.
``open``
    excluded from routing for the current cooldown (``cooldown_s`` at the first trip).
``half_open``
    the cooldown is over: exactly one request at a time may go there as the probe. The probe's
    success closes the breaker (and resets the cooldown); its fault re-opens it with the
    cooldown doubled, up to ``max_cooldown_s``. A probe that ends neither way (a 4xx, a 429, a
    client cancel) frees the probe slot for the next request.

The caller classifies each outcome (:func:`classify_status`, :func:`classify_failure`): client
errors (4xx) and 429 are never faults. Use per request::

    allowed = breaker.filter(candidates, now)        # allowed.all_open: routed anyway, count it
    ticket = breaker.begin(key_of_chosen, now)       # when the request is sent
    change = breaker.record(ticket, outcome, now)    # once, when it ends; a Transition or None

Failover: :func:`should_retry` decides whether a failed request may be tried again on another
worker (only before its first byte reached the client), :class:`Failover` tracks the workers
already tried so the next pick excludes them.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Generic, TypeVar

DEFAULT_FAILURE_THRESHOLD = 3
DEFAULT_COOLDOWN_S = 5.0
DEFAULT_MAX_COOLDOWN_S = 60.0
#: A probe not recorded after this long is presumed lost: its slot is given to a new probe.
DEFAULT_PROBE_TIMEOUT_S = 300.0
DEFAULT_MAX_RETRIES = 1

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
    NEUTRAL = "neutral"  # says nothing about the worker (4xx, 429, client cancel)


class FailureKind(StrEnum):
    """Why a request attempt failed, as the adapter observed it."""

    UNREACHABLE = "unreachable"  # worker did not answer / no responders / connection refused
    NATS_ERROR = "nats_error"  # the transport failed (publish error, disconnected)
    TIMEOUT = "timeout"  # no first token before the deadline
    OVERLOADED = "overloaded"  # 429: the worker's queue or the engine is full
    CLIENT_ERROR = "client_error"  # 4xx other than 429: the request itself is bad
    UPSTREAM_ERROR = "upstream_error"  # 5xx from the engine
    STREAM_ERROR = "stream_error"  # the upstream stream broke after it started
    CANCELLED = "cancelled"  # the client went away


_FAULTS = frozenset({FailureKind.UNREACHABLE, FailureKind.NATS_ERROR, FailureKind.TIMEOUT,
                     FailureKind.UPSTREAM_ERROR, FailureKind.STREAM_ERROR})
#: Failures that happen before any byte is produced and are safe to try on another worker.
RETRYABLE = frozenset({FailureKind.UNREACHABLE, FailureKind.NATS_ERROR, FailureKind.TIMEOUT,
                       FailureKind.OVERLOADED})


def failure_kind_for_status(status: int) -> FailureKind | None:
    """The failure an HTTP-like status means: None for 1xx-3xx, OVERLOADED for 429,
    CLIENT_ERROR for other 4xx, UPSTREAM_ERROR for 5xx and anything else."""
    if 100 <= status < 400:
        return None
    if status == 429:
        return FailureKind.OVERLOADED
    if 400 <= status < 500:
        return FailureKind.CLIENT_ERROR
    return FailureKind.UPSTREAM_ERROR


def classify_failure(kind: FailureKind | str) -> Outcome:
    """FAULT for unreachable, NATS error, timeout, 5xx, broken stream; NEUTRAL for 429, other
    4xx and cancellation."""
    return Outcome.FAULT if FailureKind(kind) in _FAULTS else Outcome.NEUTRAL


def classify_status(status: int) -> Outcome:
    """SUCCESS for 1xx-3xx, NEUTRAL for 4xx (429 included), FAULT for 5xx (and nonsense)."""
    kind = failure_kind_for_status(status)
    return Outcome.SUCCESS if kind is None else classify_failure(kind)


def should_retry(attempt: int, failure_kind: FailureKind | str, first_byte_sent: bool,
                 max_retries: int = DEFAULT_MAX_RETRIES) -> bool:
    """Whether a failed attempt may be retried on another worker.

    ``attempt`` counts the retries already made: 0 when the original attempt failed, 1 when
    the first retry failed, ... Retry only if no byte of the response reached the client yet,
    the failure is one of :data:`RETRYABLE` (unreachable, NATS error, timeout before the first
    token, 429), and fewer than ``max_retries`` retries were made.
    """
    return not first_byte_sent and FailureKind(failure_kind) in RETRYABLE and attempt < max_retries


@dataclass(slots=True)
class Failover(Generic[K]):
    """One request's attempts: the workers tried so far and whether to try once more."""

    max_retries: int = DEFAULT_MAX_RETRIES
    tried: list[K] = field(default_factory=list)

    def failed(self, worker: K, failure_kind: FailureKind | str, first_byte_sent: bool) -> bool:
        """Record a failed attempt on ``worker``; True if the request should be retried
        elsewhere (pick among :meth:`remaining`, or give up if that is empty)."""
        self.tried.append(worker)
        return should_retry(len(self.tried) - 1, failure_kind, first_byte_sent, self.max_retries)

    def remaining(self, candidates: Iterable[C], key: Callable[[C], K] | None = None) -> list[C]:
        """``candidates`` minus the workers already tried (``key`` maps a candidate to its key)."""
        tried = set(self.tried)
        return [c for c in candidates if (key(c) if key else c) not in tried]


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
        if w is None:
            if outcome is not Outcome.FAULT:
                return None
            w = self._workers[key] = _Worker(cooldown=self.cooldown_s)
        if not w.open:
            if outcome is Outcome.SUCCESS:
                w.faults = 0
            elif outcome is Outcome.FAULT:
                w.faults += 1
                if w.faults >= self.failure_threshold:
                    self._open(w, self.cooldown_s, now)
                    return Transition.TRIPPED
            return None
        if ticket.probe == 0 or ticket.probe != w.probe:
            return None
        w.probe = 0
        if outcome is Outcome.SUCCESS:
            w.open, w.faults, w.cooldown = False, 0, self.cooldown_s
            return Transition.CLOSED
        if outcome is Outcome.FAULT:
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
