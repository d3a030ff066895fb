"""A model of the public sglang-router's `cache_aware` policy (PyPI sglang-router 0.3.2, binary `smg`),
for `bench/policy_sim.py`. Our own code written from a reading of its documented behaviour and
source; not its code, and not used by the Infera router.

What the model reproduces (defaults as in sglang_router/router_args.py of 0.3.2):

* ``load(w)`` = requests the router has sent to ``w`` and not yet seen finish (its in-flight
  counter: up at dispatch, down when the response stream ends, so decoding requests count too).
* Imbalanced when ``max(load) - min(load) > balance_abs_threshold`` (64) **and**
  ``max(load) > balance_rel_threshold * min(load)`` (1.5): then the least-loaded worker (first
  listed on ties), and the request's text is still inserted into the tree for that worker.
* Otherwise the approximate tree: one multi-tenant radix tree over the requests' *text* (every
  request the router sent, inserted for the worker it went to, at dispatch; the tree never learns
  what the engines evicted). The match is the longest common prefix, in characters, of the
  request's text with any text inserted before; ``match_rate = matched chars / request chars``.
  If ``match_rate > cache_threshold`` (0.3) the request goes to a worker holding that deepest
  match; else to the least-loaded worker (first listed on ties; 0.3.2 does this, not the
  "smallest tree" its doc comment describes). Then the text is inserted for the chosen worker.
* The tree's size bound (``max_tree_size`` = 2^26 characters per worker, enforced every
  ``eviction_interval_secs`` = 60 s) is far above what one window inserts (the model reports the
  largest per-worker size, ``max_tenant_chars``, so a run can check that), so it is not modelled.

Modelling choices (where the real router depends on implementation detail):

* The bench sends token ids as text, decimal ids joined by single spaces; a prefix of ``k`` tokens
  is ``sum(len(str(id)) + 1)`` characters. The model matches whole tokens: the real tree may also
  match a few leading digits of the next id, at most one id's worth of characters.
* Among the workers holding the deepest match, the real tree returns the one cached on that tree
  node (effectively the first worker that reached it); the model takes the earliest to attach.
* The tree is stored as a trie of fixed-size token chunks with exact token-level matching inside
  the last chunk (equivalent to a token radix tree, cheaper in Python).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from infera_common.schemas import RouteRequest

from infera_router.kv_view import KvView
from infera_router.state import WorkerState

#: sglang-router 0.3.2 defaults (sglang_router/router_args.py).
CACHE_THRESHOLD = 0.3
BALANCE_ABS_THRESHOLD = 64
BALANCE_REL_THRESHOLD = 1.5
MAX_TREE_SIZE = 2**26  # characters per worker (checked every 60 s by the real router)
CHUNK = 64  # the model's trie granularity (a storage detail; matching stays token-exact)


def _common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass(slots=True)
class _Node:
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)  # full chunks
    tails: dict[tuple[int, ...], dict[str, int]] = field(default_factory=dict)  # partial last chunks -> tenants
    tenants: dict[str, int] = field(default_factory=dict)  # tenant -> attach order


class TextTree:
    """The approximate tree: which worker was sent which token prefix (never forgets)."""

    def __init__(self) -> None:
        self.root = _Node()
        self.sizes: dict[str, int] = {}  # characters inserted per tenant
        self._seq = 0

    def match(self, ids: list[int]) -> tuple[int, dict[str, int]]:
        """(matched tokens, the tenants holding that deepest match)."""
        node, depth = self.root, 0
        while True:
            key = tuple(ids[depth:depth + CHUNK])
            if not key:
                return depth, node.tenants
            child = node.children.get(key) if len(key) == CHUNK else None
            if child is not None:
                node, depth = child, depth + CHUNK
                continue
            best, holders = 0, {}
            for other, sub in node.children.items():
                n = _common(key, other)
                if n > best:
                    best, holders = n, dict(sub.tenants)
                elif n == best and n:
                    holders.update(sub.tenants)
            for other, tenants in node.tails.items():
                n = _common(key, other)
                if n > best:
                    best, holders = n, dict(tenants)
                elif n == best and n:
                    holders.update(tenants)
            if best == 0:
                return depth, node.tenants
            return depth + best, holders

    def insert(self, ids: list[int], tenant: str, chars: list[int]) -> None:
        """Record ``ids`` as sent to ``tenant``; ``chars[k]`` = characters of the first k tokens."""
        node, depth, n = self.root, 0, len(ids)
        added = 0
        while depth < n:
            key = tuple(ids[depth:depth + CHUNK])
            if len(key) < CHUNK:
                tenants = node.tails.setdefault(key, {})
                if tenant not in tenants:
                    self._seq += 1
                    tenants[tenant] = self._seq
                    added += chars[n] - chars[depth]
                break
            node = node.children.setdefault(key, _Node())
            if tenant not in node.tenants:
                self._seq += 1
                node.tenants[tenant] = self._seq
                added += chars[depth + CHUNK] - chars[depth]
            depth += CHUNK
        self.sizes[tenant] = self.sizes.get(tenant, 0) + added


def char_prefix(ids: list[int]) -> list[int]:
    """chars[k] = length of the text of the first k ids ("id id id ..."), each with its separator."""
    out = [0] * (len(ids) + 1)
    total = 0
    for i, t in enumerate(ids):
        total += len(str(t)) + 1
        out[i + 1] = total
    return out


@dataclass
class Stats:
    imbalanced: int = 0
    tree: int = 0  # routed to the holder of a match above the threshold
    low_match: int = 0  # below the threshold: least loaded


class SglangCacheAwareModel:
    """A `Policy` (infera_router.policy) modelling sglang-router cache_aware, for the simulator only.

    It ranks the chosen worker first and records the request in its tree at once (the simulator
    always dispatches to the first-ranked worker, as the real router dispatches to its pick)."""

    name = "sglang-cache-aware"
    needs_kv = False

    def __init__(self, cache_threshold: float = CACHE_THRESHOLD, balance_abs: int = BALANCE_ABS_THRESHOLD,
                 balance_rel: float = BALANCE_REL_THRESHOLD) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.tree = TextTree()
        self.stats = Stats()

    @property
    def max_tenant_chars(self) -> int:
        return max(self.tree.sizes.values(), default=0)

    def pick(self, candidates: list[WorkerState], ids: list[int]) -> str:
        loads = [w.in_flight for w in candidates]
        hi, lo = max(loads), min(loads)
        least = candidates[loads.index(lo)].worker_id  # first listed among the least loaded
        chars = char_prefix(ids)
        if hi - lo > self.balance_abs and hi > lo * self.balance_rel:
            self.stats.imbalanced += 1
            chosen = least
        else:
            matched, holders = self.tree.match(ids)
            rate = chars[matched] / chars[-1] if ids else 0.0
            live = [t for t in sorted(holders, key=holders.get) if any(w.worker_id == t for w in candidates)]
            if rate > self.cache_threshold and live:
                self.stats.tree += 1
                chosen = live[0]
            else:
                self.stats.low_match += 1
                chosen = least
        self.tree.insert(ids, chosen, chars)
        return chosen

    def rank(self, candidates: list[WorkerState], request: RouteRequest, kv: KvView | None = None) -> list[str]:
        chosen = self.pick(candidates, list(request.token_ids or []))
        return [chosen] + [w.worker_id for w in candidates if w.worker_id != chosen]
