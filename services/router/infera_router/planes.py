"""Which of a worker's planes a router cannot work with (pure: the record and the router's settings).

``--request-transport``: a worker on the other transport is not a candidate (the NATS plane needs
the agent's work queue, the HTTP plane the router's own engine calls). ``--kv-event-transport``: a
worker whose events go where this fleet's index does not read them is cache-blind: it is still
routed to, but kv-aware sees no cache on it.
"""

from __future__ import annotations

from dataclasses import dataclass

from infera_common.schemas import WorkerRecord
from infera_common.settings import PlaneSettings


@dataclass(frozen=True, slots=True)
class Mismatch:
    flag: str
    worker: str
    ours: str
    effect: str


def plane_mismatches(record: WorkerRecord, ours: PlaneSettings) -> list[Mismatch]:
    out = []
    if record.request_transport != ours.request_transport:
        out.append(Mismatch("--request-transport", record.request_transport, ours.request_transport,
                            "not routed to: requests could not reach it"))
    if record.kv_event_transport != ours.kv_event_transport:
        out.append(Mismatch("--kv-event-transport", record.kv_event_transport, ours.kv_event_transport,
                            "cache-blind: its KV events do not reach this fleet's index"))
    return out
