"""Which planes the agent serves on, and what each mix needs: pure rules, no I/O.

- (``PlaneSettings.nats_uses``, shared: the flags that put something of this worker on NATS. The
  agent connects to NATS only when one does; the no-broker plane never tries one.)
- ``plane_problems``: mixes that cannot work, refused before anything starts (exit 2), each naming
  the flag and what to change. On ``--request-transport http`` and ``--kv-event-transport zmq`` other
  hosts dial what the record advertises, so it has to be an address they can dial.
- ``plane_warnings``: mixes that work on one host only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol
from urllib.parse import urlsplit

from infera_common.kv_endpoints import split_tcp, subscriber_binds
from infera_worker_agent.engine_cmd import WILDCARD_HOSTS
from infera_worker_agent.kv_config import KvSource


class Planes(Protocol):
    discovery_backend: str
    request_transport: str
    kv_event_transport: str
    etcd_endpoint: str
    nats_url: str


def _dialled_planes(planes: Planes) -> list[str]:
    """The plane flags on which other hosts dial the engine at what the record advertises."""
    flags = []
    if planes.request_transport == "http":
        flags.append("--request-transport http")
    if planes.kv_event_transport == "zmq":
        flags.append("--kv-event-transport zmq")
    return flags


def _loopback(host: str) -> bool:
    host = host.strip("[]")
    return host == "localhost" or host == "::1" or host.startswith("127.")


def plane_problems(planes: Planes, advertise_host: str, kv_sources: Sequence[KvSource] = ()) -> list[str]:
    """Why this plane mix cannot work (empty: it can). ``kv_sources``: the publishers the engine
    is configured with (none when it publishes no KV events)."""
    problems = []
    if _dialled_planes(planes) and advertise_host.strip("[]") in WILDCARD_HOSTS:
        flags = " and ".join(_dialled_planes(planes))
        problems.append(
            f"--advertise-host {advertise_host!r} is a wildcard, not an address: with {flags} other hosts dial "
            "the engine at the advertise host; pass --advertise-host <this host's IP or name>"
        )
    if planes.kv_event_transport == "zmq":
        for source in kv_sources:
            if split_tcp(source.endpoint) is None or subscriber_binds(source.endpoint):
                problems.append(
                    f"--kv-event-transport zmq: the kv-indexer dials each engine's KV-event publisher, but DP rank "
                    f"{source.dp_rank} publishes on {source.endpoint!r}, which the engine does not bind on TCP (it "
                    "connects out, or it is not tcp://); in --kv-events-config use \"endpoint\":\"tcp://*:PORT\" "
                    "(or leave --kv-events-config out and let the agent pick ports), or use --kv-event-transport nats"
                )
                break
    return problems


def _discovery_on_this_host(planes: Planes) -> bool:
    """Whether the discovery the worker registers at is on loopback: then the whole fleet is on this host."""
    spec = planes.etcd_endpoint if planes.discovery_backend == "etcd" else planes.nats_url
    hosts = [urlsplit(item.strip() if "://" in item else f"x://{item.strip()}").hostname or ""
             for item in spec.split(",") if item.strip()]
    return bool(hosts) and all(_loopback(h) for h in hosts)


def plane_warnings(planes: Planes, advertise_host: str) -> list[str]:
    """What works on this host only (said only when the discovery is elsewhere: a fleet of one host,
    as ``infera up`` starts, works as it is)."""
    if _dialled_planes(planes) and _loopback(advertise_host) and not _discovery_on_this_host(planes):
        return [
            f"advertise host {advertise_host} is a loopback address: routers and kv-indexers on other hosts cannot "
            "reach this engine; pass --advertise-host <this host's IP or name> for a fleet across hosts"
        ]
    return []
