"""The kv-indexer's settings: one pydantic field = one ``--flag`` + one ``INFERA_*`` env var."""

from __future__ import annotations


from pydantic import Field

from infera_common.kv_index.index import UNATTACHED_GRACE
from infera_common.kv_zmq import REPLAY_TIMEOUT
from infera_common.nats_conn import KV_EVENT_MAX_AGE, KV_EVENT_MAX_BYTES
from infera_common.settings import LogSettings, PlaneSettings


class KvIndexerSettings(PlaneSettings, LogSettings):

    metrics_host: str = Field("127.0.0.1", description="Address the /metrics HTTP endpoint binds.")
    metrics_port: int = Field(9300, ge=0, le=65535, description="Port of /metrics (0 = any free port, logged).")
    kv_event_max_age: float = Field(
        KV_EVENT_MAX_AGE, gt=0,
        description="Seconds the KV event stream keeps events: how far back a restarted indexer replays "
        "(applied to the stream at start; --kv-event-transport nats).",
    )
    kv_event_max_bytes: int = Field(
        KV_EVENT_MAX_BYTES, gt=0,
        description="Bytes the KV event stream keeps, oldest discarded first (applied to the stream at start; "
        "--kv-event-transport nats).",
    )
    unattached_grace: float = Field(
        UNATTACHED_GRACE, gt=0,
        description="Seconds a worker that is not in discovery keeps its indexed blocks after its last event or "
        "its leave (waiting for its discovery record, or for it to come back after an outage with the same engine).",
    )
    kv_replay_timeout: float = Field(
        REPLAY_TIMEOUT, gt=0, le=60,
        description="Seconds to wait for an engine's KV-event replay socket (workers on --kv-event-transport zmq: "
        "the replay from seq 0 when a worker is first followed, and each sequence gap).",
    )
