"""Leases: the router's record of work it handed to a worker and has not seen finish. Pure, no I/O.

A lease is taken before the work is published and dropped on exactly one of: the worker-agent's
``Release``, a refused publish, the worker leaving discovery, or the max-age safety net.
Leases are stored in creation order, so expiring the old ones costs only what it drops.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field


@dataclass(slots=True)
class Lease:
    lease_id: str
    worker_id: str
    request_id: str
    created: float  # monotonic seconds
    prompt_tokens: int = 0
    prefill_tokens: int = 0  # of those, the ones not cached on the worker when it was picked
    prefilled: bool = False  # the worker said its first token went out: it only decodes now
    sequences: int = 1  # what the engine runs for it: ``n`` samples of each of its prompts
    samples: int = 1  # ``n``: each sample decodes over its prompt's context
    hashes: list[int] = field(default_factory=list)  # the prompt's block hashes at the worker's block size
    binding: object | None = None  # the session binding this leg holds (sessions.Binding), if any
    ticket: object | None = None  # the worker's circuit-breaker ticket (breaker.Ticket) until the lease ends
    dp_rank: int | None = None  # the DP rank the request is pinned to (a per-rank target), if any
    requester: str = ""  # where the worker answers the client (its frame subject); "" for a prefill leg

    @property
    def decode_tokens(self) -> int:
        """The context its decoding reads per step: the prompt once per sample (the shared prefill is
        computed once, but every sample attends to it)."""
        return self.prompt_tokens * self.samples

    @property
    def target_id(self) -> str:
        """The routing target's id: the worker's, or ``<worker>#<rank>`` for a pinned DP rank."""
        return self.worker_id if self.dp_rank is None else f"{self.worker_id}#{self.dp_rank}"


class LeaseTable:
    def __init__(self, id_prefix: str, start: str | None = None) -> None:
        self.prefix = id_prefix  # this router's id: every lease id starts with it
        # and then this table's own mark: a router started again under the same --router-id (a fixed
        # id) must not take a Release of its predecessor's lease (numbered from 1 too) for one of its own
        self._start = start if start is not None else secrets.token_hex(3)
        self._next = 0
        self._leases: dict[str, Lease] = {}  # insertion (= creation) order
        self._by_worker: dict[str, dict[str, Lease]] = {}

    def acquire(self, worker_id: str, request_id: str, prompt_tokens: int, now: float,
                prefill_tokens: int | None = None) -> Lease:
        self._next += 1
        prefill = prompt_tokens if prefill_tokens is None else prefill_tokens
        lease = Lease(f"{self.prefix}-{self._start}-{self._next}", worker_id, request_id, now, prompt_tokens, prefill)
        self._leases[lease.lease_id] = lease
        self._by_worker.setdefault(worker_id, {})[lease.lease_id] = lease
        return lease

    def release(self, lease_id: str) -> Lease | None:
        """Drop one lease; None when it is unknown (already released, dropped, or not ours)."""
        lease = self._leases.pop(lease_id, None)
        if lease is not None:
            held = self._by_worker[lease.worker_id]
            del held[lease_id]
            if not held:
                del self._by_worker[lease.worker_id]
        return lease

    def drop_worker(self, worker_id: str) -> list[Lease]:
        """Drop every lease held on a worker (it left the fleet)."""
        held = self._by_worker.pop(worker_id, None)
        if not held:
            return []
        for lease_id in held:
            del self._leases[lease_id]
        return list(held.values())

    def expire(self, now: float, max_age: float) -> list[Lease]:
        """Drop the leases created ``max_age`` seconds or more before ``now``."""
        old: list[str] = []
        for lease_id, lease in self._leases.items():
            if now - lease.created < max_age:
                break
            old.append(lease_id)
        return [lease for lease_id in old if (lease := self.release(lease_id)) is not None]

    def get(self, lease_id: str) -> Lease | None:
        return self._leases.get(lease_id)

    def held(self, worker_id: str) -> list[Lease]:
        """The leases held on one worker, oldest first."""
        return list(self._by_worker.get(worker_id, {}).values())

    def count(self, worker_id: str) -> int:
        return len(self._by_worker.get(worker_id, ()))

    def counts(self) -> dict[str, int]:
        return {wid: len(held) for wid, held in self._by_worker.items()}

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, lease_id: object) -> bool:
        return lease_id in self._leases
