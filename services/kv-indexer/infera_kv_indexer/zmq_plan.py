"""Which ZMQ publishers to read for a worker, and what a discovery change means for them (pure, no I/O).

A worker on ``--kv-event-transport zmq`` advertises one publisher per DP rank
(``WorkerRecord.kv_events_endpoints``) and, in the same order, its replay socket
(``kv_replay_endpoints``, ``''`` = none). A wildcard host left in an endpoint is dialled at the
worker's advertise host. A record that runs one rank per process (``dp_rank`` set) with a single
endpoint reads it as that rank; otherwise entry ``i`` is rank ``i`` (the batch's own rank, when it
carries one, still decides where its events go).

``started_at`` identifies the engine's start: a new value is a restarted engine, whose blocks the
index must forget before rebuilding them by replay.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from infera_common.kv_endpoints import advertised_endpoint
from infera_common.kv_zmq import ZmqKvSource
from infera_common.schemas import WorkerRecord


@dataclass(frozen=True, slots=True)
class WorkerFeed:
    """Where one worker's KV events are read, and which engine start they belong to."""

    started_at: float
    sources: tuple[ZmqKvSource, ...]
    state_url: str | None = None  # the agent's whole holding of this engine (``WorkerRecord.kv_state_url``)


#: ``keep``: nothing changed; ``start``: begin reading; ``restart``: the engine restarted (forget its
#: blocks, read again from seq 0); ``move``: same engine, other endpoints (read them instead, blocks
#: kept); ``stop``: no longer read (left the zmq transport, or no publisher any more).
Action = Literal["keep", "start", "restart", "move", "stop"]


def feed_for(record: WorkerRecord) -> WorkerFeed | None:
    """The publishers to read for ``record``; None when its events do not come over ZMQ."""
    if record.kv_event_transport != "zmq":
        return None
    endpoints = record.kv_events_endpoints
    replays = record.kv_replay_endpoints
    one_rank = record.dp_rank if record.dp_rank is not None and len(endpoints) == 1 else None
    sources = []
    for i, endpoint in enumerate(endpoints):
        if not endpoint:
            continue
        replay = replays[i] if i < len(replays) else ""
        sources.append(ZmqKvSource(
            one_rank if one_rank is not None else i,
            advertised_endpoint(endpoint, record.advertise_host),
            advertised_endpoint(replay, record.advertise_host) if replay else None,
        ))
    return WorkerFeed(record.started_at, tuple(sources), record.kv_state_url) if sources else None


def decide(old: WorkerFeed | None, new: WorkerFeed | None) -> Action:
    if old == new:
        return "keep"
    if new is None:
        return "stop"
    if old is None:
        return "start"
    return "restart" if new.started_at != old.started_at else "move"
