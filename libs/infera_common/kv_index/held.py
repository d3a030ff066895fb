"""Each worker's holding in the index (``KvIndex.held``), reused for a moment (pure; the clock is given).

A query's reply says how many blocks each asked worker holds, which with the worker's capacity is
how full its cache is (the router's eviction term). Listing them walks every worker of the model:
with 64 workers that cost more than the prefix walk itself (a throwaway profile of
``bench/indexer.py``: ~130 µs to list, ~115 µs to pack, against ~170 µs for the walk and its list
of depths). How full a cache is barely moves within a quarter of a second, so each (model, asked
workers) is listed once per ``max_age`` seconds and ``build`` (the reply's encoding, or nothing)
applied once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from infera_common.kv_index.index import KvIndex

T = TypeVar("T")
Held = list[tuple[str, int, int]]

#: Seconds a listing is reused.
MAX_AGE = 0.25
#: Distinct (model, asked workers) kept; past it the cache starts again.
MAX_ENTRIES = 1024


class HeldCache(Generic[T]):
    def __init__(self, index: KvIndex, build: Callable[[Held], T], clock: Callable[[], float],
                 max_age: float = MAX_AGE) -> None:
        self._index = index
        self._build = build
        self._clock = clock
        self._max_age = max_age
        self._cache: dict[tuple[str, tuple[str, ...] | None], tuple[float, T]] = {}

    def get(self, model: str, workers: list[str] | None) -> T:
        key = (model, None if workers is None else tuple(workers))
        now = self._clock()
        hit = self._cache.get(key)
        if hit is not None and now - hit[0] < self._max_age:
            return hit[1]
        if len(self._cache) >= MAX_ENTRIES:
            self._cache.clear()
        value = self._build(self._index.held(model, workers))
        self._cache[key] = (now, value)
        return value
