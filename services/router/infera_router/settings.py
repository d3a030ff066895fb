"""The router's settings: one pydantic field = one ``--flag`` + one ``INFERA_*`` env var."""

from __future__ import annotations

import re
import secrets
import socket
from typing import ClassVar, Literal

from pydantic import Field, SecretStr, model_validator

from infera_common.settings import DrainSettings, InferaSettings, LogSettings, MetricsSettings, PlaneSettings
from infera_common.subjects import TOKEN_RE

from infera_router.breaker import DEFAULT_COOLDOWN_S, DEFAULT_FAILURE_THRESHOLD, DEFAULT_MAX_COOLDOWN_S
from infera_router.pd_pairs import GuardRelease
from infera_router.policies import DEFAULT_POLICY, POLICY_NAMES
from infera_router.policy_kv_aware import DEFAULT_DECODE_WEIGHT, DEFAULT_EVICT_WEIGHT, DEFAULT_OVERLAP_WEIGHT
from infera_router.sessions import DEFAULT_AFFINITY_MODE, DEFAULT_TTL_S, MAX_TTL_S, MIN_TTL_S, AffinityMode

PolicyName = Literal[POLICY_NAMES]  # type: ignore[valid-type]  # the registry's names


class PolicySettings(InferaSettings):
    """The routing policy alone: the router's, and what ``infera up`` passes to the router it starts."""

    router_policy: PolicyName = Field(  # type: ignore[valid-type]
        DEFAULT_POLICY,
        description="How the router picks a worker among a model's active workers: kv-aware (least "
        "uncached prefill + load, asks the kv-indexer), round-robin, least-loaded.",
    )


class RouterSettings(DrainSettings, PlaneSettings, LogSettings, MetricsSettings, PolicySettings):
    metrics_service: ClassVar[str] = "router"
    kv_overlap_weight: float = Field(
        DEFAULT_OVERLAP_WEIGHT, ge=0,
        description="kv-aware: work units one cached prefix block is worth against one block of load "
        "(1 = a cached block saves one block of prefill; higher favours cache hits, lower spreads "
        "load, 0 = load only). Default chosen on the Mooncake trace with bench/policy_sim.py.",
    )
    kv_decode_weight: float = Field(
        DEFAULT_DECODE_WEIGHT, ge=0,
        description="kv-aware: what one KV block held by a request that is already decoding weighs "
        "against one block of prompt still to prefill on that worker (decode slows a new request's "
        "first token far less than a queued prefill; 0 = ignore decoding requests).",
    )
    kv_evict_weight: float = Field(
        DEFAULT_EVICT_WEIGHT, ge=0,
        description="kv-aware: what storing one uncached prompt block on a worker whose KV cache is full "
        "costs, against a cached block's --kv-overlap-weight (it evicts a block of reusable prefix; "
        "scaled by how full the cache is, so a cache with room costs nothing): keeps fresh prompts from "
        "piling onto the workers that hold the fleet's common first blocks. 0 = ignore eviction.",
    )
    kv_index: Literal["remote", "local"] = Field(
        "remote",
        description="kv-aware: where the prefix index is read. remote: ask the kv-indexer service over NATS "
        "per request; local: this router replays and follows the JetStream KV event stream itself and reads "
        "its own copy (no round trip per request; every router then holds the whole index). local needs "
        "--kv-event-transport nats.",
    )
    kv_query_timeout: float = Field(
        0.05, gt=0, le=5.0,
        description="kv-aware: seconds to wait for the kv-indexer's overlap answer; on timeout or no "
        "indexer the request is routed by load only and counted in infera_router_kv_query_failures_total.",
    )
    pd_prefill_guard_release: GuardRelease = Field(
        "hold",
        description="Disaggregated serving: when the prefill leg stops counting as load on its worker. "
        "hold: when the decode leg finishes (the prefill engine keeps the KV until the decode took it); "
        "completion: as soon as the prefill's complete answer has been drained. A failed or cancelled "
        "prefill is released at once either way.",
    )
    session_affinity: AffinityMode = Field(
        DEFAULT_AFFINITY_MODE,
        description="Keep a client session (header X-Dynamo-Session-ID) on its worker: off; prefill (the "
        "prefill or aggregated worker is kept, decode chosen per request); both (prefill, decode and "
        "aggregated targets kept, each on its own). Requests without the header route normally.",
    )
    session_affinity_ttl_seconds: float = Field(
        DEFAULT_TTL_S, ge=MIN_TTL_S, le=MAX_TTL_S,
        description="Seconds a session binding survives without a request in flight (1 to 86400).",
    )
    breaker_failure_threshold: int = Field(
        DEFAULT_FAILURE_THRESHOLD, ge=1, description="Consecutive worker faults (5xx, unreachable engine) that open a worker's circuit "
        "breaker; 4xx and 429 answers never count.",
    )
    breaker_cooldown_s: float = Field(
        DEFAULT_COOLDOWN_S, gt=0, description="Seconds an opened breaker keeps the worker out before one probe request may go.",
    )
    breaker_max_cooldown_s: float = Field(
        DEFAULT_MAX_COOLDOWN_S, gt=0, description="Ceiling of the cooldown, which doubles after each failed probe.",
    )
    lease_max_age: float = Field(
        900.0, gt=0,
        description="Seconds after which a lease whose release never arrived is dropped (and counted).",
    )
    publish_timeout: float = Field(
        2.0, gt=0, description="Seconds to wait for JetStream to acknowledge a work envelope."
    )
    engine_api_key: SecretStr | None = Field(
        None,
        description="With --request-transport http the router calls the engines itself: the key engines started "
        "with --api-key (or VLLM_API_KEY) ask for, sent to each of them. Prefer the environment variable: a "
        "command line is visible to every user of the host. On the NATS request plane the worker-agents send "
        "their engines' keys.",
    )
    router_id: str | None = Field(
        None, pattern=TOKEN_RE.pattern,
        description="This router instance's id (a subject token: letters, digits, '_', '-'); "
        "default: <hostname>-<random>, unique per process.",
    )

    @model_validator(mode="after")
    def _local_index_reads_the_stream(self) -> "RouterSettings":
        if self.kv_index == "local" and self.kv_event_transport != "nats":
            raise ValueError("--kv-index local follows the JetStream KV event stream, which exists only with "
                             "--kv-event-transport nats; use --kv-index remote (the kv-indexer reads the engines' "
                             "ZMQ publishers) or --kv-event-transport nats")
        return self

    @model_validator(mode="after")
    def _cooldowns_in_order(self) -> "RouterSettings":
        if self.breaker_max_cooldown_s < self.breaker_cooldown_s:
            raise ValueError(f"--breaker-max-cooldown-s ({self.breaker_max_cooldown_s}) must be at least "
                             f"--breaker-cooldown-s ({self.breaker_cooldown_s})")
        return self

    def resolved_router_id(self) -> str:
        return self.router_id or new_router_id()


def new_router_id() -> str:
    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:40] or "router"
    return f"{host}-{secrets.token_hex(4)}"
