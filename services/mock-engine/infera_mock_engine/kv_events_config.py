"""`--kv-events-config` as each engine reads it, and ZMQ endpoint rules (pure, no I/O).

Keys (both engines): `publisher` ("zmq" | "null"), `endpoint` (default "tcp://*:5557"),
`replay_endpoint` (optional), `buffer_steps` (10000), `hwm` (100000), `max_queue_size` (100000),
`topic` (""), and vLLM's `enable_kv_cache_events` (False).

- vLLM publishes only when `enable_kv_cache_events` is true and the publisher is "zmq"; its
  `publisher` defaults to "zmq" when events are enabled, else "null". vLLM's config is a dataclass:
  an unknown key is an error.
- SGLang ignores `enable_kv_cache_events` (not one of its keys; unknown keys are ignored) and
  publishes when `publisher` is "zmq" (default "null").

An endpoint containing `*` or `::` (or an ipc:// / inproc:// one) is bound; any other
`tcp://host:port` is connected to, as both engines do. Ports are offset by the DP rank.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

PUBLISHERS = ("zmq", "null")
DEFAULT_ENDPOINT = "tcp://*:5557"


class KvEventsConfigError(ValueError):
    """An unusable --kv-events-config (the message names the problem)."""


@dataclass(frozen=True)
class KvEventsConfig:
    publisher: str = "null"
    endpoint: str = DEFAULT_ENDPOINT
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    enable_kv_cache_events: bool = False
    flavor: str = "sglang"

    @property
    def publishes(self) -> bool:
        """Whether an engine of this flavour would publish with this config."""
        if self.flavor == "vllm":
            return self.enable_kv_cache_events and self.publisher == "zmq"
        return self.publisher == "zmq"


_KEYS = {f.name for f in fields(KvEventsConfig)} - {"flavor"}


def parse_kv_events_config(text: str, flavor: str) -> tuple[KvEventsConfig, list[str]]:
    """Parse the flag's JSON the way `flavor`'s engine does; returns the config and the keys it ignores
    (worth a warning).

    Raises KvEventsConfigError on invalid JSON, a non-object, an unknown publisher, a bad value, or
    (vLLM) an unknown key."""
    try:
        raw = json.loads(text)
    except ValueError as e:
        raise KvEventsConfigError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(raw, dict):
        raise KvEventsConfigError(f"expected a JSON object, got {type(raw).__name__}: {text!r}")
    unknown = sorted(set(raw) - _KEYS)
    if flavor == "sglang":
        ignored = list(unknown)
        if raw.get("enable_kv_cache_events") and raw.get("publisher", "null") != "zmq":
            ignored.append("enable_kv_cache_events")  # worth a warning: SGLang needs "publisher": "zmq"
        raw = {k: v for k, v in raw.items() if k in _KEYS and k != "enable_kv_cache_events"}
    else:
        if unknown:
            raise KvEventsConfigError(f"unknown key(s) {', '.join(map(repr, unknown))}; "
                                      f"known keys: {', '.join(sorted(_KEYS))}")
        ignored = []
    enable = _bool(raw, "enable_kv_cache_events", False)
    publisher = raw.get("publisher")
    if publisher is None:
        publisher = "zmq" if (flavor == "vllm" and enable) else "null"
    if publisher not in PUBLISHERS:
        raise KvEventsConfigError(f"unknown publisher {publisher!r} (choose 'zmq' or 'null')")
    endpoint = _str(raw, "endpoint", DEFAULT_ENDPOINT)
    replay = raw.get("replay_endpoint")
    if replay is not None and not isinstance(replay, str):
        raise KvEventsConfigError(f"'replay_endpoint' must be a string or null, got {replay!r}")
    config = KvEventsConfig(
        publisher=publisher,
        endpoint=endpoint,
        replay_endpoint=replay or None,
        buffer_steps=_int(raw, "buffer_steps", 10_000, minimum=1),
        hwm=_int(raw, "hwm", 100_000, minimum=0),
        max_queue_size=_int(raw, "max_queue_size", 100_000, minimum=1),
        topic=_str(raw, "topic", ""),
        enable_kv_cache_events=enable,
        flavor=flavor,
    )
    if config.publishes:
        check_endpoint(config.endpoint, "endpoint")
        if config.replay_endpoint is not None:
            check_endpoint(config.replay_endpoint, "replay_endpoint")
    return config, sorted(set(ignored))


def _bool(raw: dict[str, Any], key: str, default: bool) -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise KvEventsConfigError(f"{key!r} must be true or false, got {value!r}")
    return value


def _str(raw: dict[str, Any], key: str, default: str) -> str:
    value = raw.get(key, default)
    if not isinstance(value, str):
        raise KvEventsConfigError(f"{key!r} must be a string, got {value!r}")
    return value


def _int(raw: dict[str, Any], key: str, default: int, minimum: int) -> int:
    value = raw.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise KvEventsConfigError(f"{key!r} must be an integer >= {minimum}, got {value!r}")
    return value


def check_endpoint(endpoint: str, key: str) -> None:
    """tcp://HOST:PORT (PORT 0..65535, 0 = ephemeral), ipc://PATH or inproc://NAME."""
    if endpoint.startswith(("ipc://", "inproc://")) and endpoint.split("://", 1)[1]:
        return
    if not endpoint.startswith("tcp://"):
        raise KvEventsConfigError(f"{key!r} {endpoint!r} must be tcp://HOST:PORT, ipc://PATH or inproc://NAME")
    host, sep, port = endpoint[len("tcp://"):].rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise KvEventsConfigError(f"{key!r} {endpoint!r} must be tcp://HOST:PORT with a port in 0..65535 "
                                  "(tcp://*:PORT binds every interface; 0 picks a free port)")


def binds(endpoint: str) -> bool:
    """The engines' rule: bind a wildcard (`*`, `::`) or ipc/inproc endpoint, connect to anything else."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def offset_endpoint_port(endpoint: str | None, dp_rank: int) -> str | None:
    """The endpoint of DP rank `dp_rank`: TCP port + rank (inproc gets a `_dp<rank>` suffix).

    Rank 0 keeps the endpoint as given. Port 0 (a free port per socket) stays 0 for every rank."""
    if not endpoint or dp_rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{dp_rank}"
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return endpoint if int(port) == 0 else f"{base}:{int(port) + dp_rank}"
    return endpoint


def split_tcp(endpoint: str) -> tuple[str | None, int | None]:
    """(host, port) of a tcp:// endpoint; (None, None) for ipc/inproc."""
    if not endpoint.startswith("tcp://"):
        return None, None
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    return host, int(port)
