"""Least-loaded: prefer the worker with the least outstanding work.

Load of a worker (lower is better), compared as a tuple:

1. ``max(router_sequences, reported_sequences) + reported_engine_waiting``, all in sequences (a
   request for ``n`` samples runs ``n`` on the engine, a completions batch ``n`` per prompt):
   ``router_sequences`` are those of the requests this router handed to the worker and has not
   seen released (exact and immediate, but blind to other routers); ``reported_sequences`` are
   those of the worker-agent's in-flight requests from its last load report (covers every router,
   but up to a report interval old). The larger of the two is the best estimate of outstanding
   work; sequences the engine reports as waiting are added once more because a queue at the engine
   means it is saturated.
2. the prompt tokens of this router's leases on the worker (bigger prompts, more prefill work);
3. the engine-reported KV-cache usage;
4. ties after that are broken at random (a per-policy ``random.Random``; seed it for
   reproducibility), so several routers with the same view do not all pile onto one worker.
"""

from __future__ import annotations

import random

from infera_common.schemas import RouteRequest

from infera_router.kv_view import KvView
from infera_router.state import WorkerState, reported_sequences


def load_key(worker: WorkerState) -> tuple[int, int, float]:
    report = worker.load
    if report is None:
        return (worker.in_flight_sequences, worker.in_flight_tokens, 0.0)
    outstanding = max(worker.in_flight_sequences, reported_sequences(report)) + report.engine_waiting
    return (outstanding, worker.in_flight_tokens, report.kv_usage)


class LeastLoaded:
    name = "least-loaded"
    needs_kv = False

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def rank(self, candidates: list[WorkerState], request: RouteRequest, kv: KvView | None = None) -> list[str]:
        rnd = self._rng.random
        keyed = [(load_key(w), rnd(), w.worker_id) for w in candidates]
        keyed.sort()
        return [wid for _, _, wid in keyed]
