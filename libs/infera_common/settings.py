"""Settings declared once: one pydantic field = one ``--flag`` + one ``INFERA_*`` env var + default + help.

``parse_cli`` builds the command-line parser from the settings model itself, so a service never
declares a flag twice. Precedence: command line > environment > default. A bad value fails at
once with the field's name, the value and what is allowed (argparse's exit code 2).
"""

from __future__ import annotations

import argparse
import os
import sys
import types
import typing
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar, get_args, get_origin

from pydantic import AliasChoices, Field, ValidationError, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from infera_common.kv_wire import REPLAY_TIMEOUT
from infera_common.schemas import DISCOVERY_TTL, DiscoveryBackend, KvEventTransport, RequestTransport
from infera_common.typos import env_near_misses

ENV_PREFIX = "INFERA_"


class InferaSettings(BaseSettings):
    """Base of every service's settings: env vars are ``INFERA_<FIELD>``."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", validate_default=True)


class TracingSettings(InferaSettings):
    otlp_traces_endpoint: str | None = Field(
        None, description="OTLP/HTTP collector URL for request spans (e.g. http://127.0.0.1:4318/v1/traces); "
        "unset: no spans (a client's W3C traceparent still passes through to the engine).",
    )

    @field_validator("otlp_traces_endpoint")
    @classmethod
    def _otlp_url(cls, value: str | None) -> str | None:
        # the exporter takes anything and fails only when the first spans are sent, in a log line
        if value is not None and not value.lower().startswith(("http://", "https://")):
            raise ValueError("an OTLP/HTTP URL starts with http:// or https:// (e.g. http://HOST:4318/v1/traces)")
        return value


class LogSettings(TracingSettings):
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Log level.")
    log_format: Literal["json", "console"] = Field(
        "json", description="Log line format: one JSON object a line, or human-readable console lines."
    )


class DrainSettings(InferaSettings):
    """What a service does with the work under way when it is told to stop (frontend, router, worker-agent)."""

    drain_timeout: float = Field(
        30.0, ge=0,
        description="On SIGTERM, seconds the work under way may take to finish before it is cut: the frontend's "
        "answers (streams included, HTTP and NATS clients; their workers are then cancelled), the requests a "
        "router runs on engines itself (--request-transport http), a worker-agent's requests (with "
        "--request-transport http: until its engine reports nothing running or waiting; then the engine is "
        "stopped). New work is refused at once. Give the process manager's grace (compose stop_grace_period, "
        "Kubernetes terminationGracePeriodSeconds) a few seconds more.",
    )


#: Where each process serves its separate /metrics endpoint when ``--metrics-port`` is not given
#: (distinct, so that the services of one host do not collide); None: no separate endpoint, /metrics
#: is on the process's API port (``python -m infera.server``).
METRICS_PORTS: dict[str, int | None] = {"router": 9100, "worker-agent": 9200, "kv-indexer": 9300, "server": None}


class MetricsSettings(InferaSettings):
    """The separate /metrics (and /health) endpoint of a service; declared once for every process."""

    metrics_service: ClassVar[str]  # the key of METRICS_PORTS: each settings class names its process

    metrics_host: str = Field("127.0.0.1", description="Address the separate /metrics endpoint binds.")
    metrics_port: int | None = Field(
        None, ge=0, le=65535,
        description="Port of the separate /metrics endpoint (0: any free port, logged); unset: the process's "
        "own default, " + ", ".join(f"{k} {'none (/metrics on --port)' if v is None else v}"
                                    for k, v in METRICS_PORTS.items()) + ".",
    )

    def metrics_bind_port(self) -> int | None:
        """The port to serve /metrics on: the one given, else this process's default (None: no endpoint)."""
        return self.metrics_port if self.metrics_port is not None else METRICS_PORTS[self.metrics_service]


class KvReplaySettings(InferaSettings):
    """Reading an engine's KV-event replay socket (the worker-agent, and the kv-indexer on the ZMQ plane)."""

    kv_replay_timeout: float = Field(
        REPLAY_TIMEOUT, gt=0, le=60,
        description="Seconds to wait for an engine's KV-event replay socket: for each sequence gap, and (the "
        "kv-indexer, workers on --kv-event-transport zmq) for the replay from seq 0 when a worker is first followed.",
    )


#: The URL schemes the NATS client dials (a URL without one is taken as nats://).
NATS_SCHEMES = ("nats", "tls", "ws", "wss")


class NatsSettings(InferaSettings):
    nats_url: str = Field("nats://127.0.0.1:4222", description="NATS server URL(s), comma-separated.")

    @field_validator("nats_url")
    @classmethod
    def _nats_url_form(cls, value: str) -> str:
        # a wrong scheme would only show as "cannot reach NATS" after the connect timeout
        for url in value.split(","):
            scheme = url.strip().partition("://")[0].lower() if "://" in url else "nats"
            if not url.strip() or scheme not in NATS_SCHEMES:
                raise ValueError(f"{url.strip()!r} is not a NATS server URL: use nats://HOST:PORT "
                                 f"({', '.join(s + '://' for s in NATS_SCHEMES[1:])} also work), comma-separated")
        return value


def nats_planes(discovery_backend: str, request_transport: str, kv_event_transport: str) -> tuple[str, ...]:
    """The plane flags (as typed on the command line) that need a NATS connection; empty: none (the
    no-broker plane: etcd discovery, HTTP requests, ZMQ KV events)."""
    planes = (("--discovery-backend", discovery_backend), ("--request-transport", request_transport),
              ("--kv-event-transport", kv_event_transport))
    return tuple(f"{flag} nats" for flag, value in planes if value == "nats")


class PlaneChoices(InferaSettings):
    """The three plane flags alone (DESIGN.md, 'Planes'): every service takes them, and ``infera up``
    passes its choice to every process it starts."""

    discovery_backend: DiscoveryBackend = Field(
        "nats", description="Where workers register: a NATS JetStream KV bucket, or etcd leases."
    )
    request_transport: RequestTransport = Field(
        "nats", description="How requests reach engines: a JetStream work queue per worker, or direct HTTP."
    )
    kv_event_transport: KvEventTransport = Field(
        "nats", description="How engine KV events reach the index: relayed into JetStream, or read from ZMQ."
    )


class PlaneSettings(PlaneChoices, NatsSettings):
    """The planes and how a service reaches them: every service takes the same flags."""

    etcd_endpoint: str = Field(
        "127.0.0.1:2379",
        description="etcd host:port (several comma-separated: tried in turn), with --discovery-backend etcd.",
    )
    discovery_ttl: float = Field(
        DISCOVERY_TTL, gt=0.5, le=60.0,
        description="Seconds after its last heartbeat that a worker's discovery entry ages out "
        "(with etcd: the lease TTL, whole seconds, 2..30).",
    )

    @field_validator("etcd_endpoint")
    @classmethod
    def _etcd_endpoint_form(cls, value: str) -> str:
        from infera_common.etcd_gateway import parse_endpoints

        parse_endpoints(value)  # ValueError names the bad item
        return value

    @field_validator("discovery_ttl")
    @classmethod
    def _etcd_lease_bound(cls, value: float, info: ValidationInfo) -> float:
        from infera_common.discovery_etcd import MAX_LEASE_TTL, MIN_LEASE_TTL

        if info.data.get("discovery_backend") == "etcd" and not (
                MIN_LEASE_TTL <= value <= MAX_LEASE_TTL and value == int(value)):
            raise ValueError(f"with --discovery-backend etcd it is the etcd lease TTL: whole seconds, "
                             f"{MIN_LEASE_TTL} to {MAX_LEASE_TTL}")
        return value

    def nats_uses(self) -> tuple[str, ...]:
        """This process's plane flags that need NATS (``nats_planes``); empty: it never dials NATS."""
        return nats_planes(self.discovery_backend, self.request_transport, self.kv_event_transport)


def directory_to_write(value: str) -> str:
    """``value`` when it is a directory, or one can be created there; ValueError naming the file in the way."""
    path = Path(value).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(f"{existing} is a file: give a directory (created if absent)")
    return value


S = TypeVar("S", bound=BaseSettings)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _unwrap_optional(annotation: Any) -> Any:
    origin = get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def build_parser(cls: type[BaseSettings], prog: str, description: str = "") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description, allow_abbrev=False)
    prefix = cls.model_config.get("env_prefix", ENV_PREFIX)
    for name, field in cls.model_fields.items():
        annotation = _unwrap_optional(field.annotation)
        env = prefix + name.upper()
        if field.is_required():
            help_text = f"{field.description or ''} [env {env}; required]"
        else:
            default = field.get_default(call_default_factory=True)
            help_text = f"{field.description or ''} [env {env}; default {default!r}]"
        flags = [_flag(name)]
        if isinstance(field.validation_alias, AliasChoices):
            flags += [_flag(a) for a in field.validation_alias.choices if isinstance(a, str) and a != name]
        kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": help_text}
        if annotation is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif get_origin(annotation) is Literal:
            choices = get_args(annotation)
            kwargs["choices"] = choices
            kwargs["type"] = type(choices[0])
        elif get_origin(annotation) is list:
            kwargs["action"] = "append"
        elif annotation in (int, float, str):
            kwargs["type"] = annotation
        parser.add_argument(*flags, **kwargs)
    return parser


def env_names(cls: type[BaseSettings]) -> frozenset[str]:
    """Every environment variable ``cls`` reads (upper case): ``<prefix><FIELD>``, and its aliases."""
    config = cls.model_config
    prefix = config.get("env_prefix", ENV_PREFIX).upper()
    alias_prefix = prefix if config.get("env_prefix_target") == "all" else ""
    names = set()
    for name, field in cls.model_fields.items():
        names.add(prefix + name.upper())
        if isinstance(field.validation_alias, AliasChoices):
            names |= {alias_prefix + a.upper() for a in field.validation_alias.choices if isinstance(a, str)}
    return frozenset(names)


def parse_cli(
    cls: type[S],
    argv: list[str] | None = None,
    *,
    prog: str,
    description: str = "",
    allow_unknown: bool = False,
    env_for: tuple[type[BaseSettings], ...] = (),
) -> tuple[S, list[str]]:
    """Parse ``argv`` into ``cls``; with ``allow_unknown`` the unrecognised args are returned in order.
    An environment variable that looks like a mistyped one of ``cls`` (or of the ``env_for``
    programs, whose environment this one passes on) exits 2 with the name it meant (``typos``)."""
    parser = build_parser(cls, prog, description)
    argv = list(sys.argv[1:] if argv is None else argv)
    if allow_unknown:
        ns, rest = parser.parse_known_args(argv)
    else:
        ns, rest = parser.parse_args(argv), []
    known = env_names(cls).union(*(env_names(c) for c in env_for))
    who = f"{prog} or the services it starts" if env_for else prog
    if problems := env_near_misses(os.environ, known, cls.model_config.get("env_prefix", ENV_PREFIX), who):
        parser.error("; ".join(problems))
    try:
        settings = cls(**vars(ns))
    except ValidationError as exc:
        parser.error(_explain(exc, cls.model_config.get("env_prefix", ENV_PREFIX)))
    return settings, rest


def _explain(exc: ValidationError, prefix: str = ENV_PREFIX) -> str:
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        if not loc:  # a rule across several settings: its message names them
            lines.append(str(err["msg"]).removeprefix("Value error, "))
            continue
        flag = _flag(loc) if "." not in loc else loc
        env = prefix + loc.upper()
        if err["type"] == "missing":
            lines.append(f"{flag} (env {env}) is required")
        else:
            lines.append(f"{flag} (env {env}): {str(err['msg']).removeprefix('Value error, ')} "
                         f"(got {err.get('input')!r})")
    return "invalid setting: " + "; ".join(lines)
