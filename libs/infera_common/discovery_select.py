"""Pick the discovery backend from ``--discovery-backend``: the one line a service changes to switch.

    discovery = discovery_for(settings, js)          # js: the service's JetStream context (NATS only)
    watcher = discovery.watcher(on_change=...)       # was: Watcher(js, on_change=...)
    registrar = discovery.registrar(record)          # was: Registrar(js, record)

Both backends' watchers expose ``view`` (a ``FleetView``), ``ready``, ``start()``, ``restore()`` and
``stop()``; both registrars ``record``, ``start()``, ``set_status()``, ``restore()`` and ``stop()``
(``restore``: what to redo when the NATS connection comes back; nothing for etcd).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from nats.js.client import JetStreamContext

from infera_common.discovery import Registrar, Watcher
from infera_common.discovery_etcd import EtcdRegistrar, EtcdWatcher
from infera_common.fleet import Change, FleetView
from infera_common.schemas import DiscoveryBackend, WorkerRecord, WorkerStatus
from infera_common.settings import PlaneSettings
from infera_common.subjects import DISCOVERY_BUCKET, ETCD_WORKERS_PREFIX


class FleetWatcher(Protocol):
    view: FleetView
    ready: asyncio.Event

    async def start(self) -> None: ...

    async def restore(self) -> None: ...

    async def stop(self) -> None: ...


class FleetRegistrar(Protocol):
    record: WorkerRecord

    async def start(self) -> None: ...

    async def set_status(self, status: WorkerStatus) -> None: ...

    async def restore(self) -> None: ...

    async def stop(self, leave: bool = True) -> None: ...


@dataclass(frozen=True)
class Discovery:
    backend: DiscoveryBackend
    etcd_endpoint: str = ""
    js: JetStreamContext | None = None

    def describe(self) -> str:
        """Where this backend keeps the fleet, for logs and error messages."""
        if self.backend == "etcd":
            return f"etcd at {self.etcd_endpoint} (keys {ETCD_WORKERS_PREFIX}<worker_id>)"
        return f"nats (JetStream KV bucket {DISCOVERY_BUCKET})"

    def log_fields(self) -> dict[str, str]:
        """The fields every service logs at start: which discovery it uses, and where."""
        fields = {"discovery_backend": self.backend}
        if self.backend == "etcd":
            fields["etcd_endpoint"] = self.etcd_endpoint
        return fields

    def start_failed(self, exc: BaseException, nats_url: str = "") -> str:
        """What to tell the user when discovery could not be reached at start."""
        if self.backend == "etcd":
            return f"discovery unavailable: {exc}; is etcd running at {self.etcd_endpoint}?"
        where = f" on {nats_url}" if nats_url else ""
        return (f"cannot open the discovery bucket {DISCOVERY_BUCKET}{where} ({exc!r}); "
                "is JetStream on (nats-server -js)?")

    def watcher(self, on_change: Callable[[Change], None] | None = None) -> FleetWatcher:
        if self.backend == "etcd":
            return EtcdWatcher(self.etcd_endpoint, on_change=on_change)
        return Watcher(self._jetstream(), on_change=on_change)

    def registrar(self, record: WorkerRecord) -> FleetRegistrar:
        """A registrar for ``record``, marked with this backend (so planes that do not match are visible)."""
        record = record.model_copy(update={"discovery_backend": self.backend})
        if self.backend == "etcd":
            return EtcdRegistrar(self.etcd_endpoint, record)
        return Registrar(self._jetstream(), record)

    def _jetstream(self) -> JetStreamContext:
        if self.js is None:
            raise ValueError("--discovery-backend nats needs the service's JetStream context")
        return self.js


def discovery_for(settings: PlaneSettings, js: JetStreamContext | None = None) -> Discovery:
    """The discovery backend ``settings`` select; ``js`` is needed (only) for the NATS one."""
    return Discovery(settings.discovery_backend, settings.etcd_endpoint, js)
