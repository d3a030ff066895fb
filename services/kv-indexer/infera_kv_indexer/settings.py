"""The kv-indexer's settings: one pydantic field = one ``--flag`` + one ``INFERA_*`` env var."""

from __future__ import annotations


from typing import ClassVar

from pydantic import Field

from infera_common.kv_index.index import UNATTACHED_GRACE
from infera_common.nats_conn import KV_EVENT_MAX_AGE, KV_EVENT_MAX_BYTES
from infera_common.settings import KvReplaySettings, LogSettings, MetricsSettings, PlaneSettings


MIN_KV_EVENT_MAX_AGE = 60.0
MIN_KV_EVENT_MAX_BYTES = 1 << 20


class KvIndexerSettings(PlaneSettings, LogSettings, MetricsSettings, KvReplaySettings):
    metrics_service: ClassVar[str] = "kv-indexer"

    # Floors: the stream is shared by every indexer and local-index router, and these are applied to it
    # at start; below them a restart replays next to nothing, and 10 bytes kept no event at all, with
    # kv-aware routing blind and nothing said (runbook audit)
    kv_event_max_age: float = Field(
        KV_EVENT_MAX_AGE, ge=MIN_KV_EVENT_MAX_AGE,
        description=f"Seconds the KV event stream keeps events: how far back a restarted indexer replays "
        f"(at least {MIN_KV_EVENT_MAX_AGE:g}; applied to the shared stream at start; --kv-event-transport nats).",
    )
    kv_event_max_bytes: int = Field(
        KV_EVENT_MAX_BYTES, ge=MIN_KV_EVENT_MAX_BYTES,
        description=f"Bytes the KV event stream keeps, oldest discarded first (at least {MIN_KV_EVENT_MAX_BYTES}, "
        "1 MiB; applied to the shared stream at start; --kv-event-transport nats).",
    )
    unattached_grace: float = Field(
        UNATTACHED_GRACE, gt=0,
        description="Seconds a worker that is not in discovery keeps its indexed blocks after its last event or "
        "its leave (waiting for its discovery record, or for it to come back after an outage with the same engine).",
    )
