"""The router's decisions, without I/O: which workers to try for a request, and the load accounting.

``RouterCore`` owns the fleet state, the lease table and the policy, and keeps each worker's
in-flight counters equal to the leases it holds (the only place that changes either).
The NATS adapter (``service.py``) calls it and does the publishing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from infera_common.fleet import Change
from infera_common.schemas import LoadReport, OverlapQuery, Role, RouteRequest, WorkerRecord

from infera_router.breaker import CircuitBreaker, Outcome as BreakerOutcome, Transition
from infera_router.inflight_blocks import LINGER, InflightBlocks
from infera_router.kv_view import KvView, kv_query
from infera_router.leases import Lease, LeaseTable
from infera_router.session_pins import Held, SessionPins
from infera_router.sessions import SessionTable
from infera_router.policy import Policy
from infera_router.policy_kv_aware import WorkerCost
from infera_router.state import FleetState, WorkerState


#: How a Release outcome counts for the worker's circuit breaker: only worker/engine failures are
#: faults (the agent reports 4xx and 429 answers as ``ok``); cancelled, expired or refused is neutral.
#: An ``error`` whose engine refused the connection (``Release.unreachable``) trips it at once.
BREAKER_OUTCOMES = {"ok": BreakerOutcome.SUCCESS, "error": BreakerOutcome.FAULT}
#: A load report this many times later than its worker said: ask its agent whether it is on the bus.
OVERDUE_FACTOR = 1.5


def breaker_outcome(outcome: str | None, unreachable: bool = False) -> BreakerOutcome:
    if unreachable and outcome == "error":
        return BreakerOutcome.UNREACHABLE
    return BREAKER_OUTCOMES.get(outcome, BreakerOutcome.NEUTRAL)  # type: ignore[arg-type]


@dataclass(slots=True)
class Plan:
    """Where to try a request: ``status`` 200 with ``order`` (most preferred first), else why not."""

    status: int
    message: str = ""
    order: list[WorkerState] = field(default_factory=list)
    costs: list[WorkerCost] | None = None  # the policy's cost breakdown, same order (kv-aware only)
    decode: list[WorkerState] = field(default_factory=list)  # disaggregated: decode workers; order = prefill
    session: str | None = None  # the request's session id (affinity on and the header given)
    held: Held = field(default_factory=dict)  # session bindings found for this request, per role
    all_open: bool = False  # every worker of a pool had its breaker open: routed to them anyway

    @property
    def disaggregated(self) -> bool:
        return bool(self.decode)


@dataclass(slots=True)
class Departed:
    """A worker that left discovery with leases of this router still running there."""

    until: float  # monotonic: its leases are dropped then, unless it joins again first
    targets: list[str]  # the worker's and its DP ranks' ids: their prompts in flight (``inflight``)
    started_at: float  # its record's: back with another, it is another agent, which has none of them


class RouterCore:
    def __init__(self, policy: Policy, lease_prefix: str, lease_max_age: float,
                 sessions: SessionTable | None = None, breaker: CircuitBreaker | None = None,
                 discovery_backend: str | None = None, discovery: str = "",
                 request_transport: str | None = None) -> None:
        self.policy = policy
        self.request_transport = request_transport  # this router's; workers on the other one are not candidates
        self.discovery_backend = discovery_backend  # this router's; a request from another plane is refused
        self.discovery = discovery  # where it looks, named in refusals
        self.router_id = lease_prefix
        self.breaker: CircuitBreaker[str] = breaker if breaker is not None else CircuitBreaker()
        self.transitions: list[tuple[str, Transition]] = []  # breaker changes, drained by the adapter
        self.sessions = SessionPins(sessions)
        self.clock = 0.0  # the latest monotonic time seen (session idle times start from it)
        self.fleet = FleetState()
        self.leases = LeaseTable(lease_prefix)
        self.inflight = InflightBlocks()
        self.lease_max_age = lease_max_age
        self._departed: dict[str, Departed] = {}
        self.back_on_bus: list[str] = []  # workers that reported again after leaving the bus (drained by the adapter)

    # --- routing -------------------------------------------------------------------------
    def candidates(self, request: RouteRequest) -> Plan:
        """The workers the request may go to (unranked ``order``), or why there are none."""
        model = request.model
        theirs, ours = request.discovery_backend, self.discovery_backend
        if theirs and ours and theirs != ours:
            return Plan(503, f"the frontend follows --discovery-backend {theirs} but router {self.router_id} "
                             f"follows {self.discovery or ours}: they see different fleets; give the frontend, "
                             "router, kv-indexer and worker-agents the same --discovery-backend (and --etcd-endpoint)")
        active = self.fleet.active(model)
        if not active:
            if not self.fleet.known(model):
                where = f" in this router's discovery ({self.discovery})" if self.discovery else ""
                return Plan(404, f"model {model!r} is not served by any worker{where}")
            counts = self.fleet.status_counts(model)
            states = ", ".join(f"{n} {status}" for status, n in counts.items() if n and status != "active")
            return Plan(503, f"no active worker for model {model!r} ({states})")
        if self.request_transport is not None:
            reachable = [w for w in active if w.record.request_transport == self.request_transport]
            if not reachable:
                theirs = sorted({w.record.request_transport for w in active})
                return Plan(503, f"the {len(active)} active workers of model {model!r} take requests over "
                                 f"--request-transport {'/'.join(theirs)} but router {self.router_id} uses "
                                 f"--request-transport {self.request_transport}: give the workers and the "
                                 "router (or infera.server) the same --request-transport")
            active = reachable
        on_bus = [w for w in active if not w.off_bus]
        if on_bus:  # workers whose agent left the bus sit out, unless they are all there is
            active = on_bus
        if request.exclude:
            excluded = set(request.exclude)
            remaining = [w for w in active if w.base_id not in excluded]
            if not remaining:
                return Plan(503, f"all {len(active)} active workers of model {model!r} are excluded by the request")
            active = remaining
        pools: dict[Role, list[WorkerState]] = {role: [] for role in Role}
        for w in active:
            pools[w.record.role].append(w)
        all_open = False
        for role, pool in pools.items():  # workers whose breaker is open sit out, unless all of a pool's are
            if pool:
                allowed = self.breaker.filter(pool, self.clock, key=lambda w: w.base_id)
                pools[role] = [t for w in allowed.candidates for t in w.targets]  # DP workers: one per rank
                all_open |= allowed.all_open
        prefill, decode = pools[Role.PREFILL], pools[Role.DECODE]
        # a complete pair exists: disaggregated serving, unless the request asks for several sequences
        # (n samples, a batch), which a pair cannot carry (pd_protocol.several_sequences) and
        # aggregated workers can
        if prefill and decode and (request.sequences == 1 or not pools[Role.AGGREGATED]):
            return Plan(200, order=prefill, decode=decode, all_open=all_open)
        if pools[Role.AGGREGATED]:
            return Plan(200, order=pools[Role.AGGREGATED], all_open=all_open)
        have, missing = ("prefill", "decode") if prefill else ("decode", "prefill")
        return Plan(503, f"model {model!r} has {len(prefill or decode)} active {have} worker(s) but no active "
                         f"{missing} worker and no aggregated worker: start a {missing} worker (or an "
                         f"aggregated one) for it")

    def kv_query(self, request: RouteRequest) -> tuple[OverlapQuery, list[WorkerState]] | None:
        """The indexer query the policy wants for ``request`` and the candidates it asks about (None: not
        kv-aware, or nothing to ask)."""
        if not getattr(self.policy, "needs_kv", False):
            return None
        cands = self.candidates(request)
        query = kv_query(cands.order, request) if cands.status == 200 else None
        return (query, cands.order) if query is not None else None

    def plan(self, request: RouteRequest, kv: KvView | None = None, now: float | None = None) -> Plan:
        """Rank the candidates; with session affinity, the session's bound targets go first.
        Raises ``SessionIdError`` for a session header the affinity mode refuses."""
        session = self.sessions.session_id(request)
        self.clock = now if now is not None else self.clock
        self.inflight.expire(self.clock)
        plan = self._rank(request, kv)
        if plan.status != 200 or session is None:
            return plan
        plan.session = session
        pin = self.sessions.pin
        first_role = Role.PREFILL if plan.disaggregated else Role.AGGREGATED
        order = pin(request.model, session, first_role, plan.order, plan.held, self.clock)
        if order is not plan.order:
            if plan.costs is not None:  # keep the breakdown in the same order
                by_id = {c.worker_id: c for c in plan.costs}
                plan.costs = [by_id[w.worker_id] for w in order]
            plan.order = order
        if plan.disaggregated:
            plan.decode = pin(request.model, session, Role.DECODE, plan.decode, plan.held, self.clock)
        return plan

    def _rank(self, request: RouteRequest, kv: KvView | None) -> Plan:
        plan = self.candidates(request)
        if plan.status != 200:
            return plan
        candidates = plan.order
        if kv is not None and kv.ok and kv.hashes:
            kv = self._with_inflight(candidates, kv)
        by_id = {w.worker_id: w for w in candidates}
        explain = getattr(self.policy, "explain", None)
        decode = self._rank_decode(plan.decode, request)
        if explain is not None:
            costs = explain(candidates, request, kv)
            return Plan(200, order=[by_id[c.worker_id] for c in costs], costs=costs, decode=decode,
                        all_open=plan.all_open)
        ranked = self.policy.rank(candidates, request, kv)
        return Plan(200, order=[by_id[wid] for wid in ranked], decode=decode, all_open=plan.all_open)

    def _rank_decode(self, workers: list[WorkerState], request: RouteRequest) -> list[WorkerState]:
        """Decode workers by the policy with no cache view (their KV arrives from the prefill)."""
        if not workers:
            return []
        by_id = {w.worker_id: w for w in workers}
        return [by_id[wid] for wid in self.policy.rank(workers, request, KvView.failed("pd_decode"))]

    def _with_inflight(self, candidates: list[WorkerState], kv: KvView) -> KvView:
        """The indexer's depths, deepened where this router's in-flight prompts are about to be cached."""
        depth = dict(kv.depth)
        inflight, chains, unseen = self.inflight, kv.hashes, kv.unseen
        for w in candidates:
            if not inflight.holds(w.worker_id):
                continue
            chain = chains.get(w.block_size or 0)
            if chain and w.base_id not in unseen:
                pending = inflight.depth(w.worker_id, chain)
                if pending > depth.get(w.worker_id, 0):
                    depth[w.worker_id] = pending
        return KvView(ok=True, depth=depth, unseen=kv.unseen, hashes=kv.hashes, held=kv.held)

    # --- leases --------------------------------------------------------------------------
    def acquire(self, worker: WorkerState, request: RouteRequest, now: float, cached_tokens: int = 0,
                hashes: list[int] | None = None, plan: Plan | None = None) -> Lease:
        """Take a lease on ``worker`` for ``request`` (before publishing the work). ``now`` is monotonic;
        ``cached_tokens`` of the prompt are already cached there (the policy's view): not prefill work;
        ``hashes`` are the prompt's block hashes at the worker's block size (in flight until released);
        ``plan`` (when it carries a session) binds the session's leg to this worker."""
        self.clock = now
        prefill = max(0, request.prompt_tokens - cached_tokens)
        lease = self.leases.acquire(worker.base_id, request.request_id, request.prompt_tokens, now, prefill)
        lease.dp_rank = worker.rank
        lease.sequences, lease.samples = request.sequences, request.samples
        lease.ticket = self.breaker.begin(worker.base_id, now)
        if plan is not None and plan.session is not None:
            role = worker.record.role
            self.sessions.attach(lease, worker, request, plan.session, role, plan.held, now)
        if hashes:
            lease.hashes = hashes
            self.inflight.add(worker.worker_id, hashes)  # per target: a DP rank has its own
        self._count(lease, 1)
        return lease

    def _count(self, lease: Lease, sign: int) -> None:
        """Add (1) or take away (-1) the lease in its worker's counters."""
        for worker in self._counted(lease):
            worker.in_flight += sign
            worker.in_flight_tokens += sign * lease.prompt_tokens
            worker.in_flight_sequences += sign * lease.sequences
            if lease.prefilled:
                worker.decode_tokens += sign * lease.decode_tokens
            else:
                worker.prefill_tokens += sign * lease.prefill_tokens

    def _counted(self, lease: Lease) -> list[WorkerState]:
        """The states whose counters a lease moves: its worker and, for a DP rank, that rank's target."""
        worker = self.fleet.get(lease.worker_id)
        if worker is None:
            return []
        target = worker.target(lease.dp_rank)
        return [worker] if target is worker else [worker, target]

    def prefilled(self, lease_id: str) -> Lease | None:
        """The lease's request produced its first token: its prompt no longer waits for prefill.

        None when the lease is unknown or was already marked (a duplicate note changes nothing)."""
        lease = self.leases.get(lease_id)
        if lease is None or lease.prefilled:
            return None
        lease.prefilled = True
        for counted in self._counted(lease):
            counted.prefill_tokens -= lease.prefill_tokens
            counted.decode_tokens += lease.decode_tokens
        return lease

    def release(self, lease_id: str, outcome: str | None = None, now: float | None = None,
                unreachable: bool = False) -> Lease | None:
        """Drop one lease (released by the agent with ``outcome``, or its publish was refused); None if
        unknown. An ``error`` outcome also invalidates the session binding the lease carried; an ``ok``
        one keeps its prompt's blocks counted as cached on the worker a moment more (``inflight_blocks``).
        ``unreachable``: the worker's engine refused the connection (its breaker opens at once)."""
        if now is not None:
            self.clock = max(self.clock, now)
        lease = self.leases.release(lease_id)
        if lease is not None:
            self._unaccount(lease, outcome, unreachable)
        return lease

    def discard(self, plan: Plan) -> None:
        """The request is answered: session bindings it found but did not use are released."""
        if plan.held:
            self.sessions.discard(plan.held, self.clock)

    def expire(self, now: float) -> list[Lease]:
        """The safety net: drop leases older than the max lease age (their release was lost)."""
        self.clock = now
        dropped = self.leases.expire(now, self.lease_max_age)
        for lease in dropped:
            self._unaccount(lease)
        return dropped

    def _unaccount(self, lease: Lease, outcome: str | None = None, unreachable: bool = False) -> None:
        self.sessions.end(lease, outcome, self.clock)
        if lease.ticket is not None:
            change = self.breaker.record(lease.ticket, breaker_outcome(outcome, unreachable), self.clock)
            lease.ticket = None
            if change is not None:
                self.transitions.append((lease.worker_id, change))
        if outcome == "ok":
            self.inflight.linger(lease.target_id, lease.hashes, self.clock + LINGER)
        else:
            self.inflight.remove(lease.target_id, lease.hashes)
        self._count(lease, -1)
        departed = self._departed.get(lease.worker_id)
        if departed is not None and not self.leases.count(lease.worker_id):  # its last one: nothing to keep
            del self._departed[lease.worker_id]
            self._forget(lease.worker_id, departed.targets)

    # --- fleet ---------------------------------------------------------------------------
    def apply_change(self, change: Change, now: float | None = None) -> list[Lease]:
        """Apply a discovery change; returns the leases it dropped.

        A worker that leaves with leases of this router keeps them for ``leave_grace``: discovery can
        lose a worker that still serves (an etcd stall past the TTL, a broker outage: every watcher
        sees it leave, and its agent puts its record again moments later), and failing or forgetting
        its requests then would cut answers under way. Back within the grace with the same
        ``started_at``, its leases count on it again; back with another (its agent or engine
        restarted: nothing of them runs there) they are dropped; not back, ``departures`` drops them.
        Without leases it is forgotten at once."""
        if now is not None:
            self.clock = max(self.clock, now)
        record = change.record
        worker_id = record.worker_id
        old = self.fleet.get(worker_id)
        self.fleet.apply(change)
        if change.kind != "leave":
            departed = self._departed.pop(worker_id, None) if old is None else None
            if departed is None:
                return []
            if departed.started_at != record.started_at:
                return self._drop_departed(worker_id, departed)
            for lease in self.leases.held(worker_id):  # back: its leases count on it again
                self._count(lease, 1)
            return []
        targets = [t.worker_id for t in old.targets] if old is not None else [worker_id]
        if self.leases.count(worker_id):
            self._departed[worker_id] = Departed(self.clock + self.leave_grace(record), targets, record.started_at)
        else:
            self._forget(worker_id, targets)
        return []

    def leave_grace(self, record: WorkerRecord) -> float:
        """How long a leaving worker's leases are kept: on ``--request-transport http`` until they end
        (they are this router's own engine calls, which end by themselves if the engine is gone);
        else one discovery TTL of the worker, within which a live agent puts its record again."""
        return math.inf if self.request_transport == "http" else record.ttl

    def departures(self, now: float) -> list[tuple[str, list[Lease]]]:
        """The workers gone for longer than their grace, each with the leases dropped with it (their
        requests will not be answered by it: the adapter tells their requesters)."""
        self.clock = max(self.clock, now)
        due = [wid for wid, d in self._departed.items() if d.until <= now]
        return [(wid, self._drop_departed(wid, self._departed.pop(wid))) for wid in due]

    def _drop_departed(self, worker_id: str, departed: Departed) -> list[Lease]:
        dropped = self.leases.drop_worker(worker_id)
        for lease in dropped:  # the session keeps its binding: the next lookup falls back
            self.sessions.end(lease, None, self.clock)
        self._forget(worker_id, departed.targets)
        return dropped

    def overdue(self, now: float) -> list[tuple[str, float]]:
        """The workers on the NATS request plane whose load report is ``OVERDUE_FACTOR`` times later
        than they said, not asked about within that time: (worker id, when it last reported)."""
        self.clock = max(self.clock, now)
        late = []
        for w in self.fleet.workers():
            every, at = w.report_every, w.reported_at
            if (every is None or at is None or w.off_bus or w.record.request_transport != "nats"
                    or now - at <= OVERDUE_FACTOR * every or now - w.probed_at <= every):
                continue
            w.probed_at = now
            late.append((w.base_id, at))
        return late

    def mark_off_bus(self, worker_id: str, reported_at: float) -> bool:
        """NATS had no responder for the worker's agent: leave it out of routing (unless every
        candidate is) until it reports again. False when it reported meanwhile, or left."""
        w = self.fleet.get(worker_id)
        if w is None or w.reported_at != reported_at or w.off_bus:
            return False
        w.off_bus = True
        return True

    def departed(self, worker_id: str) -> bool:
        return worker_id in self._departed

    def _forget(self, worker_id: str, targets: list[str]) -> None:
        for target in targets:
            self.inflight.drop_worker(target)
        self.breaker.forget(worker_id)

    def apply_load(self, report: LoadReport, now: float | None = None) -> bool:
        """Keep a worker's load report (received at monotonic ``now``); from an agent that splits its
        count by router, the requests of the other routers are exact (this router's own are its
        leases, always up to date). A report brings a worker that left the bus back into routing."""
        if now is not None:
            self.clock = max(self.clock, now)
        worker = self.fleet.get(report.worker_id)
        if worker is None:
            return False
        if worker.off_bus:
            self.back_on_bus.append(report.worker_id)
        self.fleet.set_load(report, self.clock)
        worker.others_prefill = worker.others_decode = 0
        if report.by_router or not report.in_flight:
            own = self.leases.prefix
            worker.others = report.in_flight - report.by_router.get(own, 0)
            for router_id, (prefill, decode) in (report.by_router_work or {}).items():
                if router_id != own:  # sized: weighed as this router weighs its own, not as a count
                    worker.others -= report.by_router.get(router_id, 0)
                    worker.others_prefill += prefill
                    worker.others_decode += decode
        else:  # an agent that does not split its count: the policy estimates from the leases
            worker.others = None
        return True

