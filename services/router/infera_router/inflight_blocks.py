"""Blocks that are about to be cached: the prompts this router has sent and not seen finish. Pure.

The kv-indexer knows a block once the engine has computed it and its KV event has crossed the
bus. A conversation's next turn, or a second request with the same long prefix, often arrives
before that: the first request is still queued or prefilling. Routing that second request by the
index alone sends it elsewhere and computes the prefix twice. So the router also counts, per
worker, the block hashes of its in-flight leases (hashed at that worker's block size, the hashes the
query already carries), and the kv-aware depth of a worker is the deeper of the two views.

A block stays counted until its lease is released, and after a release ``ok`` for ``LINGER``
seconds more (``linger``, ``expire``): the engine has cached the prompt by then, but its KV events
may still be on their way to the index (the KV audit saw 2 of 40 follow-ups sent the moment the
answer arrived routed blind, one of them to the other worker). Past that the index knows the
blocks, or their eviction.
"""

from __future__ import annotations

from collections import Counter, deque

#: Seconds the blocks of a request that ended ``ok`` stay counted: the KV events' way to the index
#: (engine publisher, worker-agent, JetStream, kv-indexer) takes milliseconds, under load more.
LINGER = 2.0


class InflightBlocks:
    def __init__(self) -> None:
        self._by_worker: dict[str, Counter[int]] = {}
        self._lingering: deque[tuple[float, str, list[int]]] = deque()  # (until, worker, hashes), by until

    def linger(self, worker_id: str, hashes: list[int], until: float) -> None:
        """Keep ``hashes`` (added before) counted until ``until``; ``expire`` removes them then."""
        if hashes and worker_id in self._by_worker:
            self._lingering.append((until, worker_id, hashes))

    def expire(self, now: float) -> None:
        """Remove the lingering blocks whose time has come."""
        lingering = self._lingering
        while lingering and lingering[0][0] <= now:
            _, worker_id, hashes = lingering.popleft()
            self.remove(worker_id, hashes)

    def add(self, worker_id: str, hashes: list[int]) -> None:
        if hashes:
            self._by_worker.setdefault(worker_id, Counter()).update(hashes)

    def remove(self, worker_id: str, hashes: list[int]) -> None:
        held = self._by_worker.get(worker_id)
        if held is None or not hashes:
            return
        get = held.get
        for h in hashes:  # one pass (Counter.subtract is a Python loop too, and deletes none)
            n = get(h, 0) - 1
            if n > 0:
                held[h] = n
            else:
                held.pop(h, None)
        if not held:
            del self._by_worker[worker_id]

    def drop_worker(self, worker_id: str) -> None:
        self._by_worker.pop(worker_id, None)
        if any(w == worker_id for _, w, _ in self._lingering):  # (its new leases, should it return, are not these)
            self._lingering = deque(entry for entry in self._lingering if entry[1] != worker_id)

    def holds(self, worker_id: str) -> bool:
        """Whether any block is in flight on the worker."""
        return worker_id in self._by_worker

    def depth(self, worker_id: str, chain: list[int]) -> int:
        """How many leading blocks of ``chain`` are in flight on the worker."""
        held = self._by_worker.get(worker_id)
        if not held:
            return 0
        n = 0
        for h in chain:
            if h not in held:
                break
            n += 1
        return n

    def __len__(self) -> int:
        return sum(len(c) for c in self._by_worker.values())
