"""What the kv-indexer said about one request, and the query that asks it. Pure, no I/O.

``kv_query`` builds the ``OverlapQuery`` for a request (one hash list per distinct
``index_block_size`` among the candidates); ``KvView`` is the answer as the kv-aware policy reads it.
The NATS round trip itself lives in ``kv_client.py``; the router's own index (``--kv-index local``)
in ``kv_local.py``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import msgpack

from infera_common.block_hash import adapter_root, block_hashes, salted_root
from infera_common.schemas import OverlapQuery, OverlapReply, RouteRequest

from infera_router.state import WorkerState


@dataclass(slots=True)
class KvView:
    """The indexer's answer for one request.

    ``ok`` False means there is no cache information at all (no token ids, no worker with a known
    block size, indexer timeout or absent): the kv-aware policy then ranks by load only.
    ``depth`` holds matched prefix blocks per worker id (absent = 0); ``unseen`` the workers whose
    depth is unknown (the indexer never saw their events); ``held`` the blocks the index lists for each
    target, matched or not (absent: not known), which with the record's capacity is how full its
    cache is.
    """

    ok: bool
    depth: dict[str, int] = field(default_factory=dict)
    unseen: frozenset[str] = frozenset()
    failure: str = ""  # why ok is False: no_tokens, no_block_size, timeout, no_indexer, error, bad_reply
    hashes: dict[int, list[int]] = field(default_factory=dict)  # the request's block hashes per block size
    asked: bool = True  # False: answered without the indexer (``without_index``), so ``unseen`` is not known
    held: dict[str, int] = field(default_factory=dict)

    @classmethod
    def failed(cls, reason: str) -> KvView:
        return cls(ok=False, failure=reason)


def kv_query(candidates: list[WorkerState], request: RouteRequest) -> OverlapQuery | None:
    """The overlap query for ``request`` (None when there is nothing to ask: no tokens or block sizes)."""
    if not request.tokens:
        return None
    sizes = sorted({w.block_size for w in candidates if w.block_size})
    if not sizes:
        return None
    ids = request.token_ids
    record = candidates[0].record
    # a LoRA adapter's blocks chain from its own root, and a salted prompt's from its salt's
    root = salted_root(adapter_root(record.adapter(request.model)), request.cache_salt)
    return OverlapQuery(
        model=record.model,  # (a request may name an alias, or an adapter of the model)
        hashes={bs: block_hashes(ids, bs, root) for bs in sizes},
        workers=list(dict.fromkeys(w.base_id for w in candidates)),
    )


def without_index(query: OverlapQuery) -> KvView | None:
    """The answer to ``query`` when it needs no indexer: a prompt shorter than every candidate's block
    size has no full block, so no worker can hold any of it (depth 0 everywhere). None: ask the indexer."""
    if any(query.hashes.values()):
        return None
    return KvView(ok=True, hashes=query.hashes, asked=False)


def read_reply(candidates: list[WorkerState], data: bytes) -> KvView:
    """The kv-indexer's encoded reply as the policy reads it; ``ValueError`` when malformed.

    A reply lists every candidate's holding, so it is read without a pydantic model per entry when
    every field has exactly the schema's type; anything else goes through ``OverlapReply``'s own
    validation, which decides what is accepted."""
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ValueError(f"not msgpack: {exc}") from exc
    if type(raw) is dict:
        overlaps, unseen, held = _entries(raw.get("overlaps", [])), raw.get("unseen", []), _entries(raw.get("held", []))
        if overlaps is not None and held is not None and type(unseen) is list and all(type(u) is str for u in unseen):
            return depth_view(candidates, overlaps, unseen, held)
    return kv_view(candidates, OverlapReply.model_validate(raw))


def _entries(raw: object) -> list[Entry] | None:
    """``[{"worker_id", "dp_rank", "blocks"}]`` as entries, or None unless each has exactly the schema's types."""
    if type(raw) is not list:
        return None
    out = []
    for entry in raw:
        if type(entry) is not dict:
            return None
        wid, rank, blocks = entry.get("worker_id"), entry.get("dp_rank"), entry.get("blocks")
        if type(wid) is not str or type(blocks) is not int or (rank is not None and type(rank) is not int):
            return None
        out.append((wid, rank, blocks))
    return out


def kv_view(candidates: list[WorkerState], reply: OverlapReply) -> KvView:
    """Read the kv-indexer's reply as depth per routing target (``depth_view``)."""
    return depth_view(candidates, [(o.worker_id, o.dp_rank, o.blocks) for o in reply.overlaps], reply.unseen,
                      [(h.worker_id, h.dp_rank, h.blocks) for h in reply.held])


Entry = tuple[str, int | None, int]  # (worker_id, dp_rank, blocks)


def depth_view(candidates: list[WorkerState], overlaps: Iterable[Entry], unseen: Iterable[str],
               held: Iterable[Entry] = ()) -> KvView:
    """Matched depths and held blocks ``(worker_id, dp_rank, blocks)`` per routing target.

    A per-rank target of a DP worker (``rank`` set) takes its own rank's figures; a worker that pins
    one rank in its record (``record.dp_rank``) takes that rank's; any other worker the deepest
    rank's depth (its engine places the request itself) and the blocks of all its ranks.
    """
    targets: dict[str, list[WorkerState]] = {}
    for w in candidates:
        same = targets.get(w.base_id)
        if same is None:
            targets[w.base_id] = [w]
        else:
            same.append(w)
    depth: dict[str, int] = {}
    for worker_id, dp_rank, blocks in overlaps:
        for w in targets.get(worker_id, ()):
            rank = w.pinned_rank
            if rank is None or dp_rank is None or dp_rank == rank:
                wid = w.worker_id
                depth[wid] = max(depth.get(wid, 0), blocks)
    holding: dict[str, int] = {}
    for worker_id, dp_rank, blocks in held:
        for w in targets.get(worker_id, ()):
            rank = w.pinned_rank
            if rank is None or dp_rank is None or dp_rank == rank:
                wid = w.worker_id
                holding[wid] = holding.get(wid, 0) + blocks
    return KvView(ok=True, depth=depth, unseen=frozenset(unseen), held=holding)
