"""One message of the KV event stream, decoded and applied to the index (pure, no I/O).

A message is a msgpack ``KvRelay`` on ``kv_event_subject(worker_id)``. Anything unreadable is
reported as ``malformed`` (``relay``: the envelope, or a subject that is not its worker's;
``batch``: the engine batch inside) and changes nothing; bad events inside a readable batch are
counted in the outcome and the rest of the batch is applied.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from infera_common.kv_wire import KvWireError, decode_batch
from infera_common.schemas import KvRelay, decode
from infera_common.subjects import kv_event_subject

from infera_kv_indexer.index import KvIndex, Outcome


@dataclass(frozen=True, slots=True)
class Ingested:
    relay: KvRelay | None = None
    outcome: Outcome | None = None  # kind "batch" applied (or skipped as a duplicate)
    malformed: Literal["relay", "batch"] | None = None
    error: str = ""


def ingest(index: KvIndex, subject: str, data: bytes, now: float) -> Ingested:
    try:
        relay = decode(KvRelay, data)
        if kv_event_subject(relay.worker_id) != subject:
            raise ValueError(f"relay of worker {relay.worker_id!r} arrived on {subject!r}")
    except ValueError as exc:
        return Ingested(malformed="relay", error=str(exc)[:300])
    if relay.kind == "cleared":
        index.clear(relay.worker_id, relay.dp_rank, now)
        return Ingested(relay)
    try:
        batch = decode_batch(relay.payload)
    except KvWireError as exc:
        return Ingested(relay, malformed="batch", error=str(exc)[:300])
    return Ingested(relay, index.apply_batch(relay.worker_id, relay.dp_rank, relay.seq, batch, now))
