"""Small engine pages folded into larger index blocks (pure, no I/O).

SGLang resolves ``--page-size`` to 1 unless told otherwise, so its KV events carry one block per
token. Indexed at that size, a 16k-token prompt is 16k index entries, 16k relayed hashes and 16k
hashes in every router query. A ``CoarsePages`` instead indexes an engine whose page is ``p`` tokens
at ``G = k·p`` tokens (the worker's *index block size*): index block ``i`` covers the sequence's
tokens ``[i·G, (i+1)·G)`` and is held while the engine holds all ``k`` of its pages. Its hash is the
same chained ``block_hash`` hash the router computes over the request's tokens at ``G``, so a prefix
cached by the engine matches to within ``G`` tokens.

Pages are recorded by the *run* that stored them (one ``BlockStored``, or several chained ones
merged): the run keeps its tokens, preceded by those of the pages before it in its first index block,
and the index hashes of the blocks completed in it; each page is one dict entry, engine hash -> (run,
offset), set for a whole run in one C-level update. A later ``BlockStored`` whose parent page sits
inside a block continues that block with the tokens already seen, so a prefix stored over several
events (the usual case: each turn of a conversation stores only its new pages) gives the same index
hashes as one stored at once.

A block is held by the page that completes it. Engines evict the tail of a sequence first (SGLang's
radix cache frees leaves, vLLM frees a request's blocks from its end), so the page that completes a
block goes before, or with, the pages inside it, and the block leaves the index with it. A page
removed from inside a block still held (an order engines do not use) leaves that block held until
its completing page goes: the index then over-states that engine's prefix by at most one block.
"""

from __future__ import annotations

from xxhash import xxh3_64_intdigest

from infera_common.block_hash import ROOT, pack_tokens
from infera_common.int_columns import pack_map, unpack_map

_OFFSET_BITS = 32  # a page's key: run id << 32 | its offset in the run
_OFFSET_MASK = (1 << _OFFSET_BITS) - 1


class _Run:
    """Pages stored together: ``data`` holds the tokens of the ``lead`` pages before them in their
    first index block, then theirs (packed); ``blocks`` the index hashes of the blocks they complete."""

    __slots__ = ("parent", "data", "lead", "blocks", "live")

    def __init__(self, parent: int, data: bytes, lead: int, blocks: list[int], live: int) -> None:
        self.parent = parent  # the index hash before the run's first block
        self.data = data
        self.lead = lead
        self.blocks = blocks
        self.live = live  # its pages still recorded


class CoarsePages:
    """One target's pages of one engine page size, indexed at ``index_size`` (a multiple of it)."""

    __slots__ = ("page_size", "index_size", "pages", "refs", "_runs", "_next", "_k", "_page_bytes")

    def __init__(self, page_size: int, index_size: int) -> None:
        if page_size <= 0 or index_size <= page_size or index_size % page_size:
            raise ValueError(f"index block size {index_size} is not a multiple (> 1x) of the page size {page_size}")
        self.page_size = page_size
        self.index_size = index_size
        self.pages: dict[int, int] = {}  # engine hash -> its run's id << 32 | its offset in the run
        self.refs: dict[int, int] = {}  # index hash -> pages completing it (two engine pages, one content)
        self._runs: dict[int, _Run] = {}
        self._next = 0
        self._k = index_size // page_size  # pages per index block
        self._page_bytes = page_size * 4

    def start(self, parent_engine_hash: int | None, root: int = ROOT) -> tuple[int, bytes] | None:
        """Where a stored run continues from: (index parent, tokens of its block so far; ``root``, the
        chain's own root, for a run without a parent page); None when the parent page is unknown
        (the run is an orphan)."""
        if parent_engine_hash is None:
            return root, b""
        key = self.pages.get(parent_engine_hash)
        if key is None:
            return None
        run = self._runs[key >> _OFFSET_BITS]
        position = run.lead + (key & _OFFSET_MASK) + 1  # pages of ``data`` up to and including it
        done, inside = divmod(position, self._k)  # blocks of ``data`` complete at it; its pages past them
        parent = run.blocks[done - 1] if done else run.parent
        if not inside:
            return parent, b""
        start = done * self._k * self._page_bytes
        return parent, run.data[start:start + inside * self._page_bytes]

    def store(self, engine_hashes: list[int], token_ids: list[int], at: tuple[int, bytes],
              stored: set[int], removed: set[int]) -> None:
        """Record a run of pages continuing from ``at`` (``start``'s answer): the index hashes that
        become held end in ``stored``, those no longer held in ``removed``. Bad token ids raise
        before anything changes."""
        parent, partial = at
        data = partial + pack_tokens(token_ids)
        pages = self.pages
        again = [h for h in engine_hashes if h in pages]
        for engine_hash in again:  # stored before (a replay, another medium, a reused hash): as new
            self.remove(engine_hash, stored, removed)
        block_bytes = self.index_size * 4
        blocks: list[int] = []
        previous = parent
        for start in range(0, len(data) - block_bytes + 1, block_bytes):
            previous = xxh3_64_intdigest(data[start:start + block_bytes], previous)
            blocks.append(previous)
        run_id = self._next
        self._next += 1
        self._runs[run_id] = _Run(parent, data, len(partial) // self._page_bytes, blocks, len(engine_hashes))
        base = run_id << _OFFSET_BITS
        pages.update(zip(engine_hashes, range(base, base + len(engine_hashes))))
        refs = self.refs
        for index_hash in blocks:
            count = refs.get(index_hash, 0)
            refs[index_hash] = count + 1
            if not count:
                removed.discard(index_hash)
                stored.add(index_hash)

    def remove(self, engine_hash: int, stored: set[int], removed: set[int]) -> bool:
        """Forget a page; False when it was never stored here."""
        key = self.pages.pop(engine_hash, None)
        if key is None:
            return False
        run_id = key >> _OFFSET_BITS
        run = self._runs[run_id]
        done, inside = divmod(run.lead + (key & _OFFSET_MASK) + 1, self._k)
        if not inside:  # the page completes a block
            self._unref(run.blocks[done - 1], stored, removed)
        run.live -= 1
        if not run.live:
            del self._runs[run_id]
        return True

    def _unref(self, index_hash: int, stored: set[int], removed: set[int]) -> None:
        count = self.refs[index_hash] - 1
        if count:
            self.refs[index_hash] = count
            return
        del self.refs[index_hash]
        stored.discard(index_hash)
        removed.add(index_hash)


def dump_pages(coarse: CoarsePages) -> dict:
    """Everything ``load_pages`` needs to rebuild ``coarse`` (plain msgpack-able values; its pages and
    block counts as integer columns, ``int_columns``)."""
    return {
        "page_size": coarse.page_size, "index_size": coarse.index_size, "next": coarse._next,
        "pages": pack_map(coarse.pages), "refs": pack_map(coarse.refs),
        "runs": [[rid, r.parent, r.data, r.lead, r.blocks, r.live] for rid, r in coarse._runs.items()],
    }


def load_pages(state: dict) -> CoarsePages:
    """The ``CoarsePages`` ``dump_pages`` described. Raises ``ValueError`` (or ``KeyError``/
    ``TypeError``) on a malformed state. A dump without ``refs`` (an older agent's, pages as pairs)
    has its block counts recomputed from its pages, page by page."""
    coarse = CoarsePages(int(state["page_size"]), int(state["index_size"]))
    coarse._next = int(state["next"])
    for rid, parent, data, lead, blocks, live in state["runs"]:
        coarse._runs[int(rid)] = _Run(int(parent), bytes(data), int(lead), [int(b) for b in blocks], int(live))
    coarse.pages = unpack_map(state["pages"])
    if "refs" in state:
        coarse.refs = unpack_map(state["refs"])
        return coarse
    refs = coarse.refs
    for key in coarse.pages.values():
        run = coarse._runs[key >> _OFFSET_BITS]  # KeyError: a page of no run
        done, inside = divmod(run.lead + (key & _OFFSET_MASK) + 1, coarse._k)
        if not inside:  # the page completes a block, which it holds
            block = run.blocks[done - 1]
            refs[block] = refs.get(block, 0) + 1
    return coarse
