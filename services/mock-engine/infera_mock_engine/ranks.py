"""Data-parallel ranks: each rank is a scheduler with its own KV cache (and KV-event publisher), as
each DP rank of SGLang and vLLM is its own scheduler process on its own GPUs. The HTTP server in
front is shared; `pick_rank` decides which rank runs a request (pure)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

from infera_mock_engine.engine_errors import RequestError
from infera_mock_engine.kv_publisher import KvEventPublisher
from infera_mock_engine.prefix_cache import PrefixCache
from infera_mock_engine.scheduler import Scheduler, Stats


@dataclass(eq=False)
class EngineRank:
    dp_rank: int
    kv: PrefixCache
    scheduler: Scheduler
    publisher: KvEventPublisher | None = None
    task: asyncio.Task | None = None


def pick_rank(dp_size: int, *, pinned: int | None = None, room: int | None = None, round_robin: int = 0,
              pinned_by: str = "routed_dp_rank", queues: Sequence[tuple[int, int]] | None = None) -> int:
    """The DP rank of a request: the pinned one (checked), else `room % dp_size` for a disaggregated
    request (SGLang's rule, which the decode side relies on), else, given each rank's (waiting,
    running) `queues`, the least loaded by waiting × 4 + running, ties to the lowest rank (vLLM's
    balancer as one API server runs it: an idle engine sends every request to rank 0), else the
    round-robin turn (SGLang's default)."""
    if pinned is not None:
        if not 0 <= pinned < dp_size:
            raise RequestError(f"{pinned_by}={pinned} is out of range: this engine has dp_size={dp_size} "
                               f"(ranks 0..{dp_size - 1})", param=pinned_by)
        return pinned
    if room is not None:
        return room % dp_size
    if queues is not None:
        return min(range(dp_size), key=lambda r: (queues[r][0] * 4 + queues[r][1], r))
    return round_robin % dp_size


@dataclass
class Totals:
    """Sums over the ranks, for the metrics and load endpoints."""

    running: int = 0
    waiting: int = 0
    used_blocks: int = 0
    num_blocks: int = 0
    capacity_tokens: int = 0
    used_tokens: int = 0
    pd_pending: int = 0  # disaggregated requests not yet in a scheduler (waiting for their peer or KV)
    stats: Stats = field(default_factory=Stats)

    @property
    def usage(self) -> float:
        return self.used_blocks / self.num_blocks if self.num_blocks else 0.0


def totals(ranks: list[EngineRank]) -> Totals:
    t = Totals()
    for r in ranks:
        s, kv = r.scheduler, r.kv
        t.running += s.num_running
        t.waiting += s.num_waiting
        t.used_blocks += kv.used_blocks
        t.num_blocks += kv.num_blocks
        t.capacity_tokens += kv.capacity_tokens
        t.used_tokens += kv.used_blocks * kv.page_size
        st = s.stats
        t.stats.prompt_tokens += st.prompt_tokens
        t.stats.generation_tokens += st.generation_tokens
        t.stats.cached_tokens += st.cached_tokens
        t.stats.preemptions += st.preemptions
        for reason, n in st.finished.items():
            t.stats.finished[reason] = t.stats.finished.get(reason, 0) + n
    return t
