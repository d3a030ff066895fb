"""The frontend process's parts wired together: NATS, discovery, inbox, HTTP site, NATS API."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from aiohttp import web
from nats.aio.client import Client as NATS

from infera_common.discovery_select import FleetWatcher, discovery_for
from infera_common.fleet import Change
from infera_common.logs import get_logger
from infera_common.nats_conn import Reconnects, close_connection, connect, nats_log_fields, unsubscribe_quietly
from infera_common.schemas import LoadReport, decode
from infera_common.subjects import LOAD_SUBJECTS
from infera_common.tokenizer import ChatTokenizer

from infera_frontend.app import HttpApi
from infera_frontend.metrics import FrontendMetrics
from infera_frontend.nats_api import NatsApi
from infera_frontend.pipeline import Pipeline
from infera_frontend.prepare import ModelTable
from infera_frontend.inbox import Inbox
from infera_frontend.relay import Relay
from infera_frontend.settings import FrontendSettings

log = get_logger("frontend")

#: Seconds to reach NATS at start-up before giving up with a clear message.
NATS_CONNECT_TIMEOUT = 10.0


class Frontend:
    def __init__(self, settings: FrontendSettings, nc: NATS | None = None,
                 metrics: FrontendMetrics | None = None) -> None:
        """``nc``: an already connected client (e.g. ``python -m infera.server``'s in-process bus) that the
        frontend uses and does not close; by default it connects to ``--nats-url`` itself."""
        self.settings = settings
        self.frontend_id = settings.frontend_id or f"fe-{uuid.uuid4().hex[:12]}"
        self.metrics = metrics or FrontendMetrics()
        self._own_nc = nc is None
        self.discovery = discovery_for(settings)
        self.models = ModelTable(self.discovery.describe())
        self.nc: NATS | None = nc
        self.watcher: FleetWatcher | None = None
        self._reconnects = Reconnects()  # what to restore when the broker comes back (it may have restarted)
        self._load_sub = None
        self.inbox: Inbox | None = None
        self.relay: Relay | None = None
        self.nats_api: NatsApi | None = None
        self._runner: web.AppRunner | None = None
        self.http: HttpApi | None = None
        self.port: int | None = None
        self._stopped = False

    def _on_change(self, change: Change) -> None:
        self.models.apply(change)
        if change.kind == "leave":  # its per-worker series and note go with it (label cardinality)
            worker_id = change.record.worker_id
            self.metrics.forget_worker(worker_id)
            if self.relay is not None:
                self.relay.token_checker.forget(worker_id)

    def not_ready(self) -> list[str]:
        reasons = []
        if self.nc is None or not self.nc.is_connected:
            reasons.append("NATS not connected")
        if self.watcher is None or not self.watcher.ready.is_set():
            reasons.append("discovery not synced")
        return reasons

    async def start(self) -> None:
        s = self.settings
        tokenizer = await asyncio.to_thread(ChatTokenizer.from_dir, s.model_path)
        if not tokenizer.has_chat_template:
            log.warning("no_chat_template", model_path=s.model_path)
        if self.nc is None:
            self.nc = await connect(s.nats_url, f"infera-frontend-{self.frontend_id}", NATS_CONNECT_TIMEOUT,
                                    self._reconnects, planes_need_it=bool(s.nats_uses()))
        js = self.nc.jetstream() if s.discovery_backend == "nats" else None  # etcd needs no JetStream
        self.discovery = discovery_for(s, js)
        log.info("discovery", frontend_id=self.frontend_id, **nats_log_fields(s.nats_url, self._own_nc),
                 **self.discovery.log_fields())
        self.watcher = self.discovery.watcher(on_change=self._on_change)
        try:
            await self.watcher.start()
        except Exception as exc:
            raise RuntimeError(self.discovery.start_failed(exc, s.nats_url)) from exc
        # running workers this discovery does not list report load too: a plane mix to name, not to wait out
        self._load_sub = await self.nc.subscribe(LOAD_SUBJECTS, cb=self._on_load)
        self.inbox = Inbox(self.nc, self.frontend_id, s.max_unread_frames)
        await self.inbox.start()
        self.relay = Relay(self.nc, self.inbox, self.metrics, route_timeout=s.route_timeout,
                           upstream_timeout=s.upstream_timeout, request_timeout=s.request_timeout,
                           discovery_backend=s.discovery_backend)
        self._reconnects.add("frames", self.relay.resync)  # first: it only starts its checks
        self.relay.start_watch()
        self._reconnects.add("discovery", self.watcher.restore)
        pipeline = Pipeline(tokenizer, self.models, self.relay, self.metrics, s.max_body_bytes,
                            max_retries=s.request_max_retries, max_sequences=s.max_sequences_per_request,
                            tokenize_threads=s.tokenize_threads)
        http = self.http = HttpApi(pipeline, self.watcher.view, self.metrics, self.not_ready,
                                   fleet_info=self.fleet_info)
        self._runner = web.AppRunner(
            http.build(s.max_body_bytes, s.api_keys()),
            handler_cancellation=True,  # a client that disconnects cancels its handler -> Cancel upstream
            access_log=logging.getLogger("aiohttp.access") if s.access_log else None,
            shutdown_timeout=s.drain_timeout,  # what answers under way get once the port is closed
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, s.host, s.port)
        try:
            await site.start()
        except OSError as exc:  # a port in use, an address not on this host: name the flags to change
            raise OSError(exc.errno, f"--host {s.host} --port {s.port}: cannot listen there "
                                     f"({exc.strerror or exc}); pass another --port (0 = any free port) or --host") from exc
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        if s.enable_nats_api:
            self.nats_api = NatsApi(self.nc, pipeline, self.watcher.view, self.metrics)
            await self.nats_api.start()
        log.info("frontend_started", frontend_id=self.frontend_id, host=s.host, port=self.port,
                 model_path=s.model_path, nats_api=s.enable_nats_api, api_keys=len(s.api_key))  # (how many, not which)

    def fleet_info(self) -> dict:
        """Added to the /v1/workers body: this frontend's discovery, and running workers it does not list."""
        unlisted = self.models.unlisted.current(time.monotonic())
        return {"discovery": {**self.discovery.log_fields(), "where": self.discovery.describe()},
                "not_in_discovery": [u.as_json() for u in unlisted]}

    async def _on_load(self, msg) -> None:
        if self.watcher is None or not self.watcher.ready.is_set():
            return  # until the snapshot is read, every worker looks unlisted
        try:
            report = decode(LoadReport, msg.data)
        except ValueError:
            return  # the router counts undecodable load reports; here they only feed a diagnosis
        if self.models.unlisted.saw(report, self.models.lists(report.worker_id), time.monotonic()):
            log.warning("worker_not_in_discovery", worker_id=report.worker_id, model=report.model,
                        worker_discovery_backend=report.discovery_backend, worker_etcd_endpoint=report.etcd_endpoint,
                        discovery=self.discovery.describe(),
                        hint="the worker reports load on NATS but is registered elsewhere: give every service "
                             "the same --discovery-backend (and --etcd-endpoint)")

    async def stop(self) -> None:
        """Refuse new requests, drain those under way for --drain-timeout, then let go of NATS.
        Calling it again does nothing."""
        if self._stopped:
            return
        self._stopped = True
        log.info("draining", requests_under_way=self.relay.open_requests if self.relay is not None else 0,
                 drain_timeout_s=self.settings.drain_timeout)
        if self._load_sub is not None:
            await unsubscribe_quietly(self._load_sub)
            self._load_sub = None
        # both APIs stop taking requests at once, and drain what is under way side by side
        draining = []
        if self.http is not None:
            self.http.stopping = True
        if self.nats_api is not None:
            draining.append(self.nats_api.stop(self.settings.drain_timeout))
        if self._runner is not None:
            draining.append(self._runner.cleanup())
        await asyncio.gather(*draining)
        if self.relay is not None:
            await self.relay.stop_watch()
            await self.relay.drain_background()
        if self.watcher is not None:
            await self.watcher.stop()
        if self.inbox is not None:
            await self.inbox.stop()
        await self._reconnects.close()
        if self.nc is not None and self._own_nc:
            await close_connection(self.nc)
        log.info("frontend_stopped", frontend_id=self.frontend_id)
