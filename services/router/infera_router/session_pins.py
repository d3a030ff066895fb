"""Session affinity applied to a routing plan and to leases: the glue between ``SessionTable`` and
the router core. Pure, no I/O; times are passed in.

- ``pin``: after the policy ranked a request's candidates, a session's bound target (per role:
  aggregated, or prefill and decode) moves to the front when it is still a candidate (a HIT,
  which holds a lease on the session entry until the request ends). Otherwise the policy's order
  stands and the worker that takes the request becomes the binding.
- ``attach``: the lease of the worker that takes the request carries the session binding: the
  HIT's when it is that worker, else a new binding (which replaces an unavailable one).
- ``end``: the lease ended; an ``error`` outcome invalidates that leg's binding (only if it is still
  the same generation), then the binding's lease is released so idle expiry can start.
"""

from __future__ import annotations

from infera_common.schemas import Role, RouteRequest

from infera_router.leases import Lease
from infera_router.sessions import Binding, Outcome, SessionTable, Target, parse_session_header
from infera_router.state import WorkerState

Held = dict[Role, Binding]


class SessionPins:
    def __init__(self, table: SessionTable | None = None) -> None:
        self.table = table if table is not None else SessionTable("off")

    def session_id(self, request: RouteRequest) -> str | None:
        """The request's session id under the current mode; raises ``SessionIdError`` (-> 400)."""
        return parse_session_header(self.table.mode, request.session_ids)

    def pin(self, model: str, session: str | None, role: Role, order: list[WorkerState], held: Held,
            now: float) -> list[WorkerState]:
        """``order`` with the session's bound worker first (when available); the HIT goes in ``held``."""
        if session is None or not self.table.pins(role) or not order:
            return order
        by_target = {Target(w.base_id, w.rank): w for w in order}
        found = self.table.lookup(model, session, role, by_target.keys(), now)
        if found.outcome != Outcome.HIT or found.binding is None:
            return order
        held[role] = found.binding
        first = by_target[found.binding.target]
        return [first, *(w for w in order if w is not first)]

    def attach(self, lease: Lease, worker: WorkerState, request: RouteRequest, session: str | None, role: Role,
               held: Held, now: float) -> None:
        if session is None or not self.table.pins(role):
            return
        binding = held.pop(role, None)
        if binding is not None and binding.target != Target(worker.base_id, worker.rank):
            self.table.release(binding, now)  # the bound worker refused: the one that takes it is bound
            binding = None
        if binding is None:
            binding = self.table.bind(request.model, session, role, Target(worker.base_id, worker.rank), now)
        lease.binding = binding

    def end(self, lease: Lease, outcome: str | None, now: float) -> None:
        binding = lease.binding
        if binding is None:
            return
        lease.binding = None
        if outcome == "error":
            self.table.invalidate(binding)
        self.table.release(binding, now)

    def discard(self, held: Held, now: float) -> None:
        """Release HIT leases the request never used (it was refused everywhere)."""
        for binding in held.values():
            self.table.release(binding, now)
        held.clear()
