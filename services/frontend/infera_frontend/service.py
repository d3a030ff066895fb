"""The frontend process's parts wired together: NATS, discovery, inbox, HTTP site, NATS API."""

from __future__ import annotations

import asyncio
import logging
import uuid

from aiohttp import web
from nats.aio.client import Client as NATS

from infera_common.discovery import Watcher
from infera_common.logs import get_logger
from infera_common.nats_conn import close_connection, connect
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

#: Seconds in-flight HTTP responses get to finish when the frontend stops.
SHUTDOWN_GRACE = 10.0
#: Seconds to reach NATS at start-up before giving up with a clear message.
NATS_CONNECT_TIMEOUT = 10.0


class Frontend:
    def __init__(self, settings: FrontendSettings) -> None:
        self.settings = settings
        self.frontend_id = settings.frontend_id or f"fe-{uuid.uuid4().hex[:12]}"
        self.metrics = FrontendMetrics()
        self.models = ModelTable()
        self.nc: NATS | None = None
        self.watcher: Watcher | None = None
        self.inbox: Inbox | None = None
        self.relay: Relay | None = None
        self.nats_api: NatsApi | None = None
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

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
        self.nc = await connect(s.nats_url, f"infera-frontend-{self.frontend_id}", NATS_CONNECT_TIMEOUT)
        self.watcher = Watcher(self.nc.jetstream(), on_change=self.models.apply)
        try:
            await self.watcher.start()
        except Exception as exc:
            raise RuntimeError(
                f"cannot open the discovery bucket on {s.nats_url} ({exc!r}); is JetStream on (nats-server -js)?"
            ) from exc
        self.inbox = Inbox(self.nc, self.frontend_id)
        await self.inbox.start()
        self.relay = Relay(self.nc, self.inbox, self.metrics, route_timeout=s.route_timeout,
                           upstream_timeout=s.upstream_timeout, request_timeout=s.request_timeout)
        pipeline = Pipeline(tokenizer, self.models, self.relay, self.metrics, s.max_body_bytes,
                            max_retries=s.request_max_retries)
        http = HttpApi(pipeline, self.watcher.view, self.metrics, self.not_ready)
        self._runner = web.AppRunner(
            http.build(s.max_body_bytes),
            handler_cancellation=True,  # a client that disconnects cancels its handler -> Cancel upstream
            access_log=logging.getLogger("aiohttp.access") if s.access_log else None,
            shutdown_timeout=SHUTDOWN_GRACE,
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, s.host, s.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        if s.enable_nats_api:
            self.nats_api = NatsApi(self.nc, pipeline, self.watcher.view, self.metrics)
            await self.nats_api.start()
        log.info("frontend_started", frontend_id=self.frontend_id, host=s.host, port=self.port,
                 model_path=s.model_path, nats_api=s.enable_nats_api)

    async def stop(self) -> None:
        if self.nats_api is not None:
            await self.nats_api.stop()
        if self._runner is not None:
            await self._runner.cleanup()
        if self.relay is not None:
            await self.relay.drain_background()
        if self.watcher is not None:
            await self.watcher.stop()
        if self.inbox is not None:
            await self.inbox.stop()
        if self.nc is not None:
            await close_connection(self.nc)
        log.info("frontend_stopped", frontend_id=self.frontend_id)
