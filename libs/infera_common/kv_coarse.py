"""Small engine pages folded into larger index blocks (pure, no I/O).

SGLang resolves ``--page-size`` to 1 unless told otherwise, so its KV events carry one block per
token. Indexed at that size, a 16k-token prompt is 16k index entries, 16k relayed hashes and 16k
hashes in every router query. A ``CoarsePages`` instead indexes an engine whose page is ``p`` tokens
at ``G = k·p`` tokens (the worker's *index block size*): index block ``i`` covers the sequence's
tokens ``[i·G, (i+1)·G)`` and is held while the engine holds all ``k`` of its pages. Its hash is the
same chained ``block_hash`` hash the router computes over the request's tokens at ``G``, so a prefix
cached by the engine matches to within ``G`` tokens.

Each engine page is recorded with the index hash of the block before its own (its index parent)
and either the tokens of its index block so far (a page inside a block not complete at it) or the
index hash of the block it completes. A later ``BlockStored`` whose parent page sits inside a block
continues that block with the tokens already seen, so a prefix stored over several events (the usual
case: each turn of a conversation stores only its new pages) gives the same index hashes as one
stored at once.

A block is held by the page that completes it. Engines evict the tail of a sequence first (SGLang's
radix cache frees leaves, vLLM frees a request's blocks from its end), so the page that completes a
block goes before, or with, the pages inside it, and the block leaves the index with it. A page
removed from inside a block still held (an order engines do not use) leaves that block held until
its completing page goes: the index then over-states that engine's prefix by at most one block.
"""

from __future__ import annotations

from xxhash import xxh3_64_intdigest

from infera_common.block_hash import ROOT, pack_tokens

#: A page: (its index parent, its block's tokens so far packed (None once the page completes the
#: block), the index hash of the block it completes (None for a page inside a block)).
Page = tuple[int, bytes | None, int | None]


class CoarsePages:
    """One target's pages of one engine page size, indexed at ``index_size`` (a multiple of it)."""

    __slots__ = ("page_size", "index_size", "pages", "refs", "_block_bytes")

    def __init__(self, page_size: int, index_size: int) -> None:
        if page_size <= 0 or index_size <= page_size or index_size % page_size:
            raise ValueError(f"index block size {index_size} is not a multiple (> 1x) of the page size {page_size}")
        self.page_size = page_size
        self.index_size = index_size
        self.pages: dict[int, Page] = {}  # engine hash -> its Page
        self.refs: dict[int, int] = {}  # index hash -> pages completing it (two engine pages, one content)
        self._block_bytes = index_size * 4

    def start(self, parent_engine_hash: int | None) -> tuple[int, bytes] | None:
        """Where a stored run continues from: (index parent, tokens of its block so far); None when
        the parent page is unknown (the run is an orphan)."""
        if parent_engine_hash is None:
            return ROOT, b""
        page = self.pages.get(parent_engine_hash)
        if page is None:
            return None
        parent, partial, completes = page
        if completes is not None:
            return completes, b""
        return parent, partial  # type: ignore[return-value]

    def store(self, engine_hashes: list[int], token_ids: list[int], at: tuple[int, bytes],
              stored: set[int], removed: set[int]) -> None:
        """Record a run of pages continuing from ``at`` (``start``'s answer): the index hashes that
        become held end in ``stored``, those no longer held in ``removed``. Bad token ids raise
        before anything changes."""
        data = pack_tokens(token_ids)
        parent, partial = at
        step, full = self.page_size * 4, self._block_bytes
        pages, refs = self.pages, self.refs
        start = 0
        for engine_hash in engine_hashes:
            end = start + step
            partial = partial + data[start:end]
            start = end
            if len(partial) == full:
                completes: int | None = xxh3_64_intdigest(partial, parent)
                page: Page = (parent, None, completes)
                parent, partial = completes, b""  # type: ignore[assignment]
            else:
                completes = None
                page = (parent, partial, None)
            old = pages.get(engine_hash)
            if old == page:
                continue  # stored again (another medium, a replay)
            if old is not None and old[2] is not None:  # the engine reused a hash for other content
                self.unref(old[2], stored, removed)
            pages[engine_hash] = page
            if completes is not None:
                count = refs.get(completes, 0)
                refs[completes] = count + 1
                if not count:
                    removed.discard(completes)
                    stored.add(completes)

    def remove(self, engine_hash: int, stored: set[int], removed: set[int]) -> bool:
        """Forget a page; False when it was never stored here."""
        page = self.pages.pop(engine_hash, None)
        if page is None:
            return False
        if page[2] is not None:
            self.unref(page[2], stored, removed)
        return True

    def unref(self, index_hash: int, stored: set[int], removed: set[int]) -> None:
        count = self.refs[index_hash] - 1
        if count:
            self.refs[index_hash] = count
            return
        del self.refs[index_hash]
        stored.discard(index_hash)
        removed.add(index_hash)
