"""Engine-like KV event batches for kv-indexer tests, in both wire encodings.

``FakeEngine`` keeps a prefix cache the way an engine reports it: each newly cached full block
gets an opaque engine hash (vLLM: unsigned 64-bit, SGLang: signed), a ``BlockStored`` names the
engine hash of the block before the new ones as its parent, and ``BlockRemoved`` names engine
hashes. ``vllm`` writes map batches with map events, ``sglang`` array batches with positional events.
``relay`` wraps a batch as ``relay_kind`` says: ``"batch"`` (raw, translated by the indexer) or
``"blocks"`` (translated first, as the worker-agent relays it).
"""

from __future__ import annotations

import random
from typing import Literal

import msgpack

from infera_common.block_hash import adapter_root, salted_root, block_hashes
from infera_common.kv_translate import BlockTranslator, delta_relay
from infera_common.kv_wire import decode_batch
from infera_common.schemas import KvRelay, OverlapQuery, WorkerRecord, WorkerStatus, encode, encode_sparse
from infera_common.subjects import kv_event_subject

MODEL = "smol"
Flavour = Literal["vllm", "sglang"]


class FakeEngine:
    relay_kind: Literal["batch", "blocks"] = "batch"

    def __init__(self, worker_id: str, flavour: Flavour = "vllm", block_size: int = 4,
                 dp_rank: int | None = None, seed: int = 0) -> None:
        self.worker_id = worker_id
        self.flavour = flavour
        self.block_size = block_size
        self.dp_rank = dp_rank
        self.seq = -1
        self._rng = random.Random(f"{worker_id}/{dp_rank}/{seed}")
        self._hashes: dict[tuple[int, ...], int] = {}  # cached prefix (full blocks) -> engine hash
        self._translators: dict[int, BlockTranslator] = {}  # the worker-agent's, per rank

    def engine_hash(self, tokens: list[int], block: int) -> int:
        """The engine hash of block ``block`` (0-based) of ``tokens`` (it must be cached)."""
        return self._hashes[tuple(tokens[:(block + 1) * self.block_size])]

    def _new_hash(self) -> int:
        h = self._rng.getrandbits(64) | (1 << 63)  # beyond the signed range: as vLLM's often are
        return h - (1 << 64) if self.flavour == "sglang" else h

    # --- events ---------------------------------------------------------------------------------
    def stored(self, tokens: list[int]):
        """A BlockStored for the full blocks of ``tokens`` not cached yet (None if all are)."""
        bs = self.block_size
        n = len(tokens) // bs
        first = 0
        while first < n and tuple(tokens[:(first + 1) * bs]) in self._hashes:
            first += 1
        if first == n:
            return None
        parent = self._hashes[tuple(tokens[:first * bs])] if first else None
        new = []
        for i in range(first, n):
            h = self._hashes[tuple(tokens[:(i + 1) * bs])] = self._new_hash()
            new.append(h)
        body = tokens[first * bs:n * bs]
        if self.flavour == "vllm":
            return {"type": "BlockStored", "block_hashes": new, "parent_block_hash": parent, "token_ids": body,
                    "block_size": bs, "lora_id": None, "medium": "GPU", "lora_name": None}
        return ["BlockStored", new, parent, body, bs, None, None]

    def removed(self, tokens: list[int], first_block: int):
        """A BlockRemoved for blocks ``first_block``.. of ``tokens`` (forgotten by this engine)."""
        n = len(tokens) // self.block_size
        gone = [self._hashes.pop(tuple(tokens[:(i + 1) * self.block_size])) for i in range(first_block, n)]
        if self.flavour == "vllm":
            return {"type": "BlockRemoved", "block_hashes": gone, "medium": "GPU"}
        return ["BlockRemoved", gone, None]

    def cleared(self):
        self._hashes.clear()
        return {"type": "AllBlocksCleared"} if self.flavour == "vllm" else ["AllBlocksCleared"]

    # --- batches and relays ---------------------------------------------------------------------
    def batch(self, events: list, ts: float = 1.0) -> bytes:
        events = [e for e in events if e is not None]
        if self.flavour == "vllm":
            return msgpack.packb({"ts": ts, "events": events, "data_parallel_rank": self.dp_rank})
        return msgpack.packb([ts, events, self.dp_rank] if self.dp_rank is not None else [ts, events])

    def relay(self, *events, seq: int | None = None, ts: float | None = None) -> bytes:
        """One KvRelay message carrying a batch of ``events`` with the engine's next seq (``ts``: when
        it was relayed; default now)."""
        self.seq = self.seq + 1 if seq is None else seq
        payload = self.batch(list(events))
        if self.relay_kind == "batch":
            relay = KvRelay(worker_id=self.worker_id, seq=self.seq, payload=payload, block_size=self.block_size)
            return encode(relay if ts is None else relay.model_copy(update={"ts": ts}))
        batch = decode_batch(payload)
        rank = batch.dp_rank if batch.dp_rank is not None else 0
        delta = self._translators.setdefault(rank, BlockTranslator()).apply(batch.events)
        relay = delta_relay(self.worker_id, rank, self.seq, delta, self.block_size)
        return encode_sparse(relay if ts is None else relay.model_copy(update={"ts": ts}))

    @property
    def subject(self) -> str:
        return kv_event_subject(self.worker_id)


def cleared_relay(worker_id: str, dp_rank: int | None = None) -> bytes:
    return encode(KvRelay(worker_id=worker_id, kind="cleared", dp_rank=dp_rank))


def query(tokens: list[int], block_sizes=(4,), model: str = MODEL, workers: list[str] | None = None,
          adapter: str | None = None, salt: str | None = None) -> OverlapQuery:
    """The router's query for a request of ``tokens`` (under LoRA ``adapter``, with ``cache_salt``
    ``salt``): its chained hashes at every block size."""
    root = salted_root(adapter_root(adapter), salt)
    return OverlapQuery(model=model, hashes={bs: block_hashes(tokens, bs, root) for bs in block_sizes},
                        workers=workers)


def record(worker_id: str, model: str = MODEL, block_size: int = 4, dp_size: int = 1,
           started_at: float | None = None) -> WorkerRecord:
    extra = {} if started_at is None else {"started_at": started_at}
    return WorkerRecord(worker_id=worker_id, model=model, engine="mock", url="http://127.0.0.1:1",
                        advertise_host="127.0.0.1", kv_block_size=block_size, dp_size=dp_size,
                        status=WorkerStatus.ACTIVE, **extra)


def depths(reply) -> dict[tuple[str, int | None], int]:
    return {(o.worker_id, o.dp_rank): o.blocks for o in reply.overlaps}


def tokens(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))
