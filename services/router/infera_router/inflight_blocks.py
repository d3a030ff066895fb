"""Blocks that are about to be cached: the prompts this router has sent and not seen finish. Pure.

The kv-indexer knows a block once the engine has computed it and its KV event has crossed the
bus. A conversation's next turn, or a second request with the same long prefix, often arrives
before that: the first request is still queued or prefilling. Routing that second request by the
index alone sends it elsewhere and computes the prefix twice. So the router also counts, per
worker, the block hashes of its in-flight leases (hashed at that worker's block size, the hashes the
query already carries), and the kv-aware depth of a worker is the deeper of the two views.

A block stays counted until its lease is released: by then the engine has cached it and the index
knows it, or it has been evicted, which the index also says.
"""

from __future__ import annotations

from collections import Counter


class InflightBlocks:
    def __init__(self) -> None:
        self._by_worker: dict[str, Counter[int]] = {}

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
