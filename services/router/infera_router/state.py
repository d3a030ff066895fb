"""The router's view of the fleet, per model: pure bookkeeping, no I/O.

Fed by discovery changes (``infera_common.fleet.Change``) and load reports. Each worker carries
the router's own in-flight counters (maintained by ``RouterCore`` together with the lease table)
so that policies read everything they need from one object.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from infera_common.fleet import Change
from infera_common.schemas import LoadReport, WorkerRecord, WorkerStatus


def reported_sequences(report: LoadReport) -> int:
    """The sequences the agent's in-flight requests run on the engine (its requests, from an agent
    too old to say): the engine's running and waiting figures count sequences, not requests."""
    return report.in_flight if report.in_flight_sequences is None else report.in_flight_sequences


@dataclass(slots=True, eq=False)
class WorkerState:
    """One worker as the router sees it, or one DP rank of it (a routing target).

    A worker whose engine runs ``dp_size > 1`` data-parallel ranks behind one endpoint (its record
    has no ``dp_rank``) is routed to per rank: ``ranks`` holds one target per rank, each with its
    own counters and its own cache view, and ``worker_id`` of a rank target is ``<worker>#<rank>``
    (policies, cache depths and in-flight blocks are keyed by it). ``base_id`` is always the real
    worker id: subjects, leases, breakers, replies. The worker's own counters sum its ranks'.
    """

    record: WorkerRecord
    load: LoadReport | None = None  # the latest load report, if any arrived
    in_flight: int = 0  # leases this router holds on the worker (or rank)
    in_flight_tokens: int = 0  # prompt tokens of those leases
    in_flight_sequences: int = 0  # the sequences those leases run on the engine (``n`` x prompts each)
    prefill_tokens: int = 0  # uncached prompt tokens of the leases whose prefill is not known to be done
    decode_tokens: int = 0  # prompt tokens, times their samples, of the leases past their first token
    others: int | None = None  # requests on it other routers leased (from its load report), when known,
    #                            less those whose size the report gives (``others_prefill``/``others_decode``)
    others_prefill: int = 0  # prompt tokens still to prefill of the other routers' requests (load report)
    others_decode: int = 0  # prompt tokens x samples of the other routers' requests past their first token
    reported_at: float | None = None  # monotonic time of its latest load report (None: none yet)
    report_every: float | None = None  # seconds between its reports, as it said
    probed_at: float = 0.0  # when its agent was last asked whether it is on the bus (off_bus.py)
    off_bus: bool = False  # its agent left the bus: out of routing until it reports again
    rank: int | None = None  # the DP rank this target pins (None: the whole worker)
    ranks: list[WorkerState] = field(default_factory=list)  # per-rank targets of a DP worker

    # derived from ``record`` and ``rank`` (``_derive``; change the record with ``set_record``): read
    # for every candidate of every route request, so kept as plain attributes
    worker_id: str = field(init=False, default="")  # the routing target's id: ``<worker>`` or ``<worker>#<rank>``
    base_id: str = field(init=False, default="")  # the real worker id (subjects, leases, breakers, replies)
    block_size: int | None = field(init=False, default=None)  # ``record.index_block_size``: what requests hash at
    pinned_rank: int | None = field(init=False, default=None)  # the DP rank its requests run on, if one:
    #                                                            its own, or the one its record pins
    targets: list[WorkerState] = field(init=False, default_factory=list, repr=False)  # where its requests can be pinned:
    #                                                                        its ranks, or itself
    capacity_blocks: int = field(init=False, default=0)  # its KV capacity in blocks of ``block_size`` (0: unknown):
    #                                                      the record's per DP rank, times the ranks it spans

    def __post_init__(self) -> None:
        self._derive()

    def _derive(self) -> None:
        record = self.record
        self.base_id = record.worker_id
        self.worker_id = record.worker_id if self.rank is None else f"{record.worker_id}#{self.rank}"
        self.block_size = record.index_block_size
        self.pinned_rank = self.rank if self.rank is not None else record.dp_rank
        self.targets = self.ranks or [self]
        ranks = 1 if self.pinned_rank is not None else max(1, record.dp_size)
        bs = self.block_size
        self.capacity_blocks = record.kv_capacity_tokens * ranks // bs if record.kv_capacity_tokens and bs else 0

    def target(self, rank: int | None) -> WorkerState:
        if rank is None or not self.ranks or not 0 <= rank < len(self.ranks):
            return self
        return self.ranks[rank]

    def set_record(self, record: WorkerRecord) -> None:
        self.record = record
        self._derive()
        per_rank = record.dp_size if record.dp_size > 1 and record.dp_rank is None else 0
        if len(self.ranks) != per_rank:
            self.ranks = [WorkerState(record, rank=r) for r in range(per_rank)]
        for target in self.ranks:
            target.record = record
            target._derive()
        self.targets = self.ranks or [self]

    @property
    def model(self) -> str:
        return self.record.model

    @property
    def active(self) -> bool:
        return self.record.status == WorkerStatus.ACTIVE


@dataclass(slots=True)
class _ModelFleet:
    workers: dict[str, WorkerState] = field(default_factory=dict)
    active: list[WorkerState] = field(default_factory=list)  # sorted by worker id

    def reindex(self) -> None:
        self.active = sorted((w for w in self.workers.values() if w.active), key=lambda w: w.worker_id)


class FleetState:
    """Workers indexed by id and by model (each name a worker serves: its model and aliases); the
    active list per model is kept sorted by id."""

    def __init__(self) -> None:
        self._workers: dict[str, WorkerState] = {}
        self._models: dict[str, _ModelFleet] = {}

    # --- discovery -------------------------------------------------------------------
    def apply(self, change: Change) -> WorkerState | None:
        """Apply a join/update/leave; returns the affected state (the removed one on leave)."""
        record = change.record
        if change.kind == "leave":
            return self._remove(record.worker_id)
        state = self._workers.get(record.worker_id)
        if state is None:
            state = WorkerState(record)
            state.set_record(record)
            self._workers[record.worker_id] = state
        elif state.record.served_names != record.served_names:
            self._detach(state)
            state.set_record(record)
        elif state.record.status == record.status:  # a heartbeat: nothing to re-index
            state.set_record(record)
            return state
        else:
            state.set_record(record)
        for name in record.served_names:  # listed under each name a request may give (its aliases too)
            fleet = self._models.setdefault(name, _ModelFleet())
            fleet.workers[record.worker_id] = state
            fleet.reindex()
        return state

    def _remove(self, worker_id: str) -> WorkerState | None:
        state = self._workers.pop(worker_id, None)
        if state is not None:
            self._detach(state)
        return state

    def _detach(self, state: WorkerState) -> None:
        for name in state.record.served_names:
            fleet = self._models.get(name)
            if fleet is None:
                continue
            fleet.workers.pop(state.worker_id, None)
            if fleet.workers:
                fleet.reindex()
            else:
                del self._models[name]

    # --- load --------------------------------------------------------------------------
    def set_load(self, report: LoadReport, now: float = 0.0) -> bool:
        """Keep the latest report of a known worker (received at monotonic ``now``); False (ignored) for
        an unknown one."""
        state = self._workers.get(report.worker_id)
        if state is None:
            return False
        state.load = report
        state.reported_at, state.report_every, state.off_bus = now, report.report_every, False
        return True

    # --- queries -----------------------------------------------------------------------
    def get(self, worker_id: str) -> WorkerState | None:
        return self._workers.get(worker_id)

    def known(self, model: str) -> bool:
        """True when any worker, in any status, serves ``model``."""
        return model in self._models

    def active(self, model: str) -> list[WorkerState]:
        """Active workers of ``model`` sorted by worker id (do not mutate the list)."""
        fleet = self._models.get(model)
        return fleet.active if fleet is not None else []

    def status_counts(self, model: str) -> dict[str, int]:
        counts = {s.value: 0 for s in WorkerStatus}
        fleet = self._models.get(model)
        if fleet is not None:
            for w in fleet.workers.values():
                counts[w.record.status.value] += 1
        return counts

    def models(self) -> list[str]:
        return sorted(self._models)

    def workers(self) -> list[WorkerState]:
        return list(self._workers.values())

    def __len__(self) -> int:
        return len(self._workers)
