"""ZMQ KV-event endpoints: who binds, how a local reader and the fleet reach them (pure, no I/O).

The engines bind an endpoint with a wildcard host (``tcp://*:P``; ``/kv_event_sources`` reports
the bind as ``tcp://0.0.0.0:P``) and connect out to a concrete ``tcp://host:port``. A reader on the
engine's host (the worker-agent) dials a wildcard at 127.0.0.1; the rest of the fleet (the
kv-indexer on ``--kv-event-transport zmq``) dials it at the worker's advertise host, which is what
the worker record carries.
"""

from __future__ import annotations

import re

_TCP = re.compile(r"^tcp://(?P<host>\[[^\]]*\]|[^:/]*|\*):(?P<port>\d+)$")
_WILDCARDS = {"*", "0.0.0.0", "::", "[::]", ""}
LOCAL_HOST = "127.0.0.1"


def split_tcp(endpoint: str) -> tuple[str, int] | None:
    """``tcp://host:port`` -> (host, port); None for anything else (ipc://, inproc://, malformed)."""
    m = _TCP.match(endpoint)
    return (m.group("host"), int(m.group("port"))) if m else None


def is_wildcard(endpoint: str) -> bool:
    """Whether ``endpoint`` is a ``tcp://`` endpoint on a wildcard host (a bind, not an address to dial)."""
    parts = split_tcp(endpoint)
    return parts is not None and parts[0] in _WILDCARDS


def engine_binds(endpoint: str) -> bool:
    """Whether the engine binds ``endpoint`` (else it connects and the subscriber must bind)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def subscriber_binds(endpoint: str) -> bool:
    """Whether the subscriber must bind: the engine connects to a concrete ``tcp://host:port``.

    A wildcard host (``tcp://0.0.0.0:P`` as /kv_event_sources reports a ``tcp://*:P`` bind) means
    the engine bound it.
    """
    if is_wildcard(endpoint):
        return False
    return not engine_binds(endpoint)


def url_host(host: str) -> str:
    """A host as it appears in a URL (IPv6 literals in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def local_endpoint(endpoint: str) -> str:
    """How a reader on the engine's host reaches ``endpoint``: wildcard hosts become 127.0.0.1."""
    parts = split_tcp(endpoint)
    if parts is None or parts[0] not in _WILDCARDS:
        return endpoint
    return f"tcp://{LOCAL_HOST}:{parts[1]}"


def advertised_endpoint(endpoint: str, advertise_host: str) -> str:
    """How the fleet reaches ``endpoint``: wildcard hosts become the advertise host."""
    parts = split_tcp(endpoint)
    if parts is None or parts[0] not in _WILDCARDS:
        return endpoint
    return f"tcp://{url_host(advertise_host)}:{parts[1]}"
