"""Session affinity: which worker a client's session stays on. Pure, no I/O, time passed in.

A client opts in per request with a session id (header ``X-Dynamo-Session-ID``; the NATS API
carries every value of it in ``RouteRequest.session_ids``). Requests without one route normally. The id is only
a routing key: it is never added to the model's input, and it is scoped by model and role, so
the same id names independent bindings for ``(model, prefill)``, ``(model, decode)`` and
``(model, aggregated)``.

Modes (``--session-affinity``):

``off`` (default)
    the header is ignored entirely (not even validated); nothing is pinned.
``prefill``
    a session keeps its prefill target; decode is chosen normally every time. Aggregated
    workers are pinned too, because an aggregated worker is the one that does the prefill
    (that is where the session's KV-cache prefix lives).
``both``
    prefill, decode and aggregated targets are each kept, independently of one another
    (a session's prefill rank and decode rank need not match).

The table never picks a target. The routing policy picks a new session's target as usual;
the table only answers "bound target or none" (:meth:`SessionTable.lookup`) and records the
policy's pick afterwards (:meth:`SessionTable.bind`). Typical use for one leg of a request::

    found = table.lookup(model, sid, role, available, now)
    if found.binding is not None:                # HIT: use found.binding.target
        binding = found.binding
    else:                                        # MISS / FALLBACK / NOT_PINNED: the policy picks
        target = policy_pick(...)
        binding = table.bind(model, sid, role, target, now)   # None: not pinned / table full
    ...
    if the leg failed and binding: table.invalidate(binding)
    when the leg ends and binding: table.release(binding, now)

Every :class:`Binding` returned by ``lookup`` (a hit) or ``bind`` holds one *lease* on its
session entry: call :meth:`SessionTable.release` exactly once for it when the request ends
(success or failure). An entry with a lease is never expired nor evicted; its idle time counts
from the last release. Idle entries older than the TTL are dropped lazily on lookup, by
:meth:`SessionTable.expire` (call it periodically), and reclaimed when the table is full.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal, NamedTuple

from infera_common.schemas import SESSION_HEADER, Role

AffinityMode = Literal["off", "prefill", "both"]
AFFINITY_MODES: tuple[str, ...] = ("off", "prefill", "both")
DEFAULT_AFFINITY_MODE: AffinityMode = "off"

#: Longest accepted session id, in UTF-8 bytes.
MAX_SESSION_ID_BYTES = 1024

#: ``--session-affinity-ttl-seconds``: default and allowed range (inclusive), in seconds.
DEFAULT_TTL_S = 3600.0
MIN_TTL_S = 1.0
MAX_TTL_S = 86400.0
#: Most model/session/role entries the table holds.
DEFAULT_MAX_ENTRIES = 65536

_PINNED_ROLES: dict[str, frozenset[Role]] = {
    "off": frozenset(),
    "prefill": frozenset({Role.PREFILL, Role.AGGREGATED}),
    "both": frozenset({Role.PREFILL, Role.DECODE, Role.AGGREGATED}),
}


class SessionIdError(ValueError):
    """A session id the router refuses; ``str(err)`` is the client-facing message (HTTP 400)."""


def check_mode(mode: str) -> AffinityMode:
    """Return ``mode`` if it is a known affinity mode, else raise ValueError."""
    if mode not in _PINNED_ROLES:
        raise ValueError(f"session affinity mode must be one of {', '.join(AFFINITY_MODES)}, not {mode!r}")
    return mode  # type: ignore[return-value]


def check_ttl(seconds: float) -> float:
    """Validate ``--session-affinity-ttl-seconds`` (1 to 86400); for a settings field validator."""
    if not MIN_TTL_S <= seconds <= MAX_TTL_S:
        raise ValueError(
            f"session affinity TTL must be between {MIN_TTL_S:g} and {MAX_TTL_S:g} seconds, not {seconds:g}"
        )
    return seconds


def pinned_roles(mode: str) -> frozenset[Role]:
    """The roles whose targets a mode keeps per session."""
    return _PINNED_ROLES[check_mode(mode)]


def check_session_id(mode: str, session_id: str | None) -> str | None:
    """Validate one session id (one value of ``RouteRequest.session_ids``) under ``mode``.

    Returns the id to use, or None when affinity is off or no id was given. Raises
    :class:`SessionIdError` for an empty (or all-whitespace) id or one longer than
    :data:`MAX_SESSION_ID_BYTES` UTF-8 bytes. The id is otherwise kept verbatim.
    """
    if check_mode(mode) == "off" or session_id is None:
        return None
    if not session_id.strip():
        raise SessionIdError(f"{SESSION_HEADER} must not be empty")
    size = len(session_id.encode("utf-8", "surrogatepass"))
    if size > MAX_SESSION_ID_BYTES:
        raise SessionIdError(f"{SESSION_HEADER} is {size} bytes long; the limit is {MAX_SESSION_ID_BYTES} bytes")
    return session_id


def parse_session_header(mode: str, values: Sequence[str] | None) -> str | None:
    """The session id of one HTTP request, from every value of its :data:`SESSION_HEADER` header.

    ``values`` is the list of the header's occurrences (e.g. aiohttp's
    ``request.headers.getall(SESSION_HEADER, [])``). Off mode ignores the header entirely and
    returns None. Enabled modes return None without the header, the id when it is given once,
    and raise :class:`SessionIdError` (turn it into HTTP 400) when it is given more than once,
    empty, or longer than :data:`MAX_SESSION_ID_BYTES` bytes.
    """
    if check_mode(mode) == "off" or not values:
        return None
    if len(values) > 1:
        raise SessionIdError(f"{SESSION_HEADER} was sent {len(values)} times; send it once")
    return check_session_id(mode, values[0])


class Target(NamedTuple):
    """Where one leg of a request runs: a worker and, for a data-parallel engine, its rank."""

    worker_id: str
    dp_rank: int | None = None


class Outcome(StrEnum):
    HIT = "hit"  # the session's bound target is available: use it
    MISS = "miss"  # no binding (new session, expired, or invalidated): the policy picks, then bind
    FALLBACK = "fallback"  # the bound target is unavailable: the policy picks, then bind replaces it
    NOT_PINNED = "not_pinned"  # no session id, or this mode does not pin this role: route normally


@dataclass(slots=True, frozen=True)
class Binding:
    """A session's target as handed to one request, holding one lease on the session's entry.

    ``epoch`` identifies this generation of the binding: :meth:`SessionTable.invalidate` only
    deletes the binding while it is still the same generation. ``lease_id`` is unique per
    returned Binding, so a duplicate :meth:`SessionTable.release` is ignored.
    """

    model: str
    session_id: str
    role: Role
    target: Target
    epoch: int
    lease_id: int


@dataclass(slots=True, frozen=True)
class Lookup:
    outcome: Outcome
    binding: Binding | None = None  # set on HIT only
    previous: Target | None = None  # FALLBACK: the bound target that was unavailable


@dataclass(slots=True)
class RoleStats:
    """Per-role counters (cumulative since start) and gauges (current); no session ids."""

    hits: int = 0  # lookups answered with the bound target
    misses: int = 0  # lookups of pinned roles with no usable binding (new, expired, invalidated)
    fallbacks: int = 0  # lookups whose bound target was unavailable (routed by the policy instead)
    selections: int = 0  # bindings recorded (new sessions and replacements)
    expired: int = 0  # idle entries dropped after the TTL (lazily, by expire(), or reclaimed)
    invalidated: int = 0  # bindings deleted after a failed request / upstream stream
    unbound_full: int = 0  # policy picks not recorded because the table was full
    active_leases: int = 0  # gauge: requests currently holding a lease
    bindings: int = 0  # gauge: entries currently bound to a target


_Key = tuple[str, Role, str]  # (model, role, session id)


@dataclass(slots=True)
class _Entry:
    target: Target | None
    epoch: int
    last_used: float
    leases: set[int] = field(default_factory=set)


class SessionTable:
    """The session-affinity table: ``(model, role, session id) -> target``, with TTL and leases.

    ``mode``: off | prefill | both (see the module doc). ``ttl_s``: idle seconds after which an
    unleased entry is dropped. ``max_entries``: capacity; when full, a new session's pick is not
    recorded (the request routes normally) unless an idle-expired entry can be reclaimed;
    entries with leases are never evicted.
    """

    def __init__(self, mode: str = DEFAULT_AFFINITY_MODE, ttl_s: float = DEFAULT_TTL_S,
                 max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self.mode: AffinityMode = check_mode(mode)
        self.ttl_s = check_ttl(ttl_s)
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, not {max_entries}")
        self.max_entries = max_entries
        self._pinned = _PINNED_ROLES[self.mode]
        self._entries: dict[_Key, _Entry] = {}
        # unleased bound entries, least recently used first (the expiry order)
        self._idle: OrderedDict[_Key, None] = OrderedDict()
        self._next_epoch = 0
        self._next_lease = 0
        self._stats = {role: RoleStats() for role in Role}

    # --- queries -------------------------------------------------------------------------

    def pins(self, role: Role | str) -> bool:
        """Whether this mode keeps a per-session target for ``role``."""
        return Role(role) in self._pinned

    def lookup(self, model: str, session_id: str | None, role: Role | str,
               available: Callable[[Target], bool] | Collection[Target], now: float) -> Lookup:
        """The session's bound target for ``role``, if it is still usable.

        ``available`` is the set of targets the request may go to right now (or a predicate on
        a :class:`Target`): active, not excluded, breaker not open. Outcomes:

        - HIT: the bound target is available; the returned binding holds a lease (release it).
        - FALLBACK: the bound target is unavailable; the binding is kept (it becomes usable
          again if the target comes back) until :meth:`bind` records the policy's new pick.
        - MISS: no binding (new session, idle-expired, or invalidated).
        - NOT_PINNED: no session id, or the mode does not pin ``role``.
        """
        role = Role(role)
        if session_id is None or role not in self._pinned:
            return Lookup(Outcome.NOT_PINNED)
        stats = self._stats[role]
        key = (model, role, session_id)
        entry = self._entries.get(key)
        if entry is not None and entry.target is not None and self._is_expired(entry, now):
            self._drop(key, entry)
            stats.expired += 1
            entry = None
        if entry is None or entry.target is None:
            stats.misses += 1
            return Lookup(Outcome.MISS)
        usable = available(entry.target) if callable(available) else entry.target in available
        if not usable:
            stats.fallbacks += 1
            return Lookup(Outcome.FALLBACK, previous=entry.target)
        stats.hits += 1
        return Lookup(Outcome.HIT, self._lease(key, entry, now))

    def get(self, model: str, session_id: str, role: Role | str) -> Target | None:
        """The bound target, without checks, counters or leases (for debugging and tests)."""
        entry = self._entries.get((model, Role(role), session_id))
        return None if entry is None else entry.target

    # --- updates -------------------------------------------------------------------------

    def bind(self, model: str, session_id: str | None, role: Role | str, target: Target,
             now: float) -> Binding | None:
        """Record the policy's pick for a session after a MISS or FALLBACK; it replaces any
        previous binding and gets a new epoch. Returns the binding, holding one lease, or None
        when nothing was recorded: no session id, role not pinned, or the table is full (the
        request then routes normally; counted in ``unbound_full``)."""
        role = Role(role)
        if session_id is None or role not in self._pinned:
            return None
        stats = self._stats[role]
        key = (model, role, session_id)
        entry = self._entries.get(key)
        if entry is None:
            if len(self._entries) >= self.max_entries and not self._reclaim_one(now):
                stats.unbound_full += 1
                return None
            entry = self._entries[key] = _Entry(None, 0, now)
        if entry.target is None:
            stats.bindings += 1
        self._next_epoch += 1
        entry.target = Target(*target)
        entry.epoch = self._next_epoch
        stats.selections += 1
        return self._lease(key, entry, now)

    def release(self, binding: Binding, now: float) -> bool:
        """End the request's lease; idle time counts from the last release. False when the
        lease is unknown (already released)."""
        key = (binding.model, binding.role, binding.session_id)
        entry = self._entries.get(key)
        if entry is None or binding.lease_id not in entry.leases:
            return False
        entry.leases.remove(binding.lease_id)
        self._stats[binding.role].active_leases -= 1
        entry.last_used = now
        if not entry.leases:
            if entry.target is None:
                self._drop(key, entry)
            else:
                self._idle[key] = None  # newest at the end
        return True

    def invalidate(self, binding: Binding) -> bool:
        """Delete the binding after its request or upstream stream failed, so the session's
        next request is routed anew. Only the failed leg's role is affected, and only while the
        binding is still the generation ``binding`` was handed out for: a late failure of an
        older request cannot delete a newer binding. Leases are unaffected (release them as
        usual). True when a binding was deleted."""
        key = (binding.model, binding.role, binding.session_id)
        entry = self._entries.get(key)
        if entry is None or entry.target is None or entry.epoch != binding.epoch:
            return False
        stats = self._stats[binding.role]
        stats.invalidated += 1
        if entry.leases:
            entry.target = None
            stats.bindings -= 1
        else:
            self._drop(key, entry)
        return True

    def expire(self, now: float) -> int:
        """Drop every unleased entry idle for ``ttl_s`` or more; returns how many."""
        dropped = 0
        while self._idle:
            key = next(iter(self._idle))
            entry = self._entries[key]
            if not self._is_expired(entry, now):
                break
            self._drop(key, entry)
            self._stats[key[1]].expired += 1
            dropped += 1
        return dropped

    # --- introspection -------------------------------------------------------------------

    def stats(self) -> dict[Role, RoleStats]:
        """A snapshot (copies) of the per-role counters and gauges, for metrics."""
        return {role: RoleStats(**{f: getattr(s, f) for f in RoleStats.__dataclass_fields__})
                for role, s in self._stats.items()}

    def __len__(self) -> int:
        """Entries held (bound ones, and invalidated ones still leased by running requests)."""
        return len(self._entries)

    # --- internals -----------------------------------------------------------------------

    def _is_expired(self, entry: _Entry, now: float) -> bool:
        return not entry.leases and now - entry.last_used >= self.ttl_s

    def _lease(self, key: _Key, entry: _Entry, now: float) -> Binding:
        assert entry.target is not None
        self._next_lease += 1
        if not entry.leases:
            self._idle.pop(key, None)
        entry.leases.add(self._next_lease)
        entry.last_used = now
        self._stats[key[1]].active_leases += 1
        return Binding(key[0], key[2], key[1], entry.target, entry.epoch, self._next_lease)

    def _drop(self, key: _Key, entry: _Entry) -> None:
        stats = self._stats[key[1]]
        del self._entries[key]
        self._idle.pop(key, None)
        stats.active_leases -= len(entry.leases)
        if entry.target is not None:
            stats.bindings -= 1

    def _reclaim_one(self, now: float) -> bool:
        """Free one slot by dropping the least recently used idle entry, if it has expired."""
        if not self._idle:
            return False
        key = next(iter(self._idle))
        entry = self._entries[key]
        if not self._is_expired(entry, now):
            return False
        self._drop(key, entry)
        self._stats[key[1]].expired += 1
        return True
