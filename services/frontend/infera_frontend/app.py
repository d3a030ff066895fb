"""The OpenAI HTTP API (aiohttp): completions relayed through the fleet, plus models, workers, health.

Routes: POST /v1/chat/completions, POST /v1/completions (optional header ``X-Dynamo-Session-ID``,
every value passed to the router for session affinity), GET /v1/models, GET /v1/models/{model}
(OpenAI's "retrieve model"), GET /v1/workers (every worker record, plus this frontend's
``discovery`` and the running workers ``not_in_discovery``), GET /health (process up), GET /ready
(NATS connected and discovery synced, else 503), GET /metrics (Prometheus). With ``--api-key``
every route but the last three asks for a key (``auth.py``). Every error is an
OpenAI error body (aiohttp's own 404 and 405 too, through ``openai_http_errors``); every completion
response carries ``X-Request-Id``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence

from aiohttp import web

from infera_common.fleet import FleetView
from infera_common.logs import get_logger
from infera_common.metrics import metrics_response
from infera_common.openai_errors import error_body
from infera_common.schemas import Endpoint
from infera_common.tracing import HEADER as TRACE_HEADER

from infera_frontend import sse
from infera_frontend.auth import make_auth_middleware
from infera_frontend.listing import model_entry, models_list, workers_list
from infera_frontend.metrics import FrontendMetrics
from infera_frontend.pipeline import Pipeline
from infera_frontend.exchange import Exchange
from infera_frontend.served import Served, serving
from infera_frontend.session import SESSION_HEADER, http_session_ids
from infera_frontend.validation import ApiError

log = get_logger("frontend.http")

_JSON = "application/json"


#: seconds a client refused with 429 (every worker at its pending limit) is told to wait: queues
#: drain in about a request's time, and clients that honour it do not retry in a tight loop
RETRY_AFTER_S = 1
#: as nginx's send_timeout: how long a stopped reader keeps its connection (``HttpApi.slow_client_grace``)
SLOW_CLIENT_GRACE_S = 60.0


def error_response(err: ApiError, request_id: str | None) -> web.Response:
    body = error_body(err.status, err.message, type=err.type, param=err.param, code=err.code)
    headers = {"X-Request-Id": request_id} if request_id else {}
    if err.status == 429:
        headers["Retry-After"] = str(RETRY_AFTER_S)
    return web.Response(body=json.dumps(body).encode(), status=err.status, content_type=_JSON, headers=headers)


@web.middleware
async def openai_http_errors(request: web.Request, handler) -> web.StreamResponse:
    """aiohttp's own refusals (no such route, wrong method) as OpenAI error bodies, like every other error."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        if exc.status == 404:
            message = f"Invalid URL ({request.method} {request.path}): no such route."
        elif exc.status == 405:
            message = f"Method {request.method} is not allowed for {request.path}; allowed: {exc.headers.get('Allow')}."
        else:
            message = exc.reason
        resp = error_response(ApiError(exc.status, message, type="invalid_request_error"), None)
        if "Allow" in exc.headers:
            resp.headers["Allow"] = exc.headers["Allow"]
        return resp


class HttpApi:
    def __init__(
        self, pipeline: Pipeline, view: FleetView, metrics: FrontendMetrics, ready: Callable[[], list[str]],
        fleet_info: Callable[[], dict] | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.view = view
        self._fleet_info = fleet_info  # extra /v1/workers keys: this frontend's discovery, unlisted workers
        self.metrics = metrics
        self._not_ready = ready  # returns the reasons the frontend is not ready (empty: ready)
        self.stopping = False  # set when the frontend drains: a cancelled handler was cut, not left
        #: seconds a client whose stream was cancelled for reading too slowly has to read what waited,
        #: before its connection is closed (it may never read again: its handler and frames would stay)
        self.slow_client_grace = SLOW_CLIENT_GRACE_S

    def build(self, max_body_bytes: int, api_keys: Sequence[str] = ()) -> web.Application:
        """The application; with ``api_keys``, every route but the probes asks for one of them (``auth``)."""
        middlewares = [openai_http_errors]
        if api_keys:
            middlewares.insert(0, make_auth_middleware(api_keys, self.metrics.unauthorized.inc))
        # aiohttp refuses bodies of client_max_size bytes or more: allow exactly max_body_bytes
        app = web.Application(client_max_size=max_body_bytes + 1, middlewares=middlewares)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.model)  # model ids may hold slashes (org/name)
        app.router.add_get("/v1/workers", self.workers)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/metrics", self.metrics_page)
        return app

    # --- completions --------------------------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, Endpoint.CHAT)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, Endpoint.COMPLETIONS)

    async def _read_body(self, request: web.Request) -> bytes:
        size = request.content_length
        if size is not None and size > self.pipeline.max_body_bytes:
            raise self.pipeline.too_large(size)
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise self.pipeline.too_large(self.pipeline.max_body_bytes + 1) from None

    async def _complete(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        with serving(self.pipeline, "http", endpoint, request.headers.get(TRACE_HEADER)) as s:
            try:
                s.take_ids(request.headers.get("X-Request-Id"))
                body = await self._read_body(request)
                s.parse(body)
                ex = await s.open(body, session_ids=http_session_ids(request.headers.getall(SESSION_HEADER, [])))
                if ex.body is not None:
                    return web.Response(body=ex.body, status=ex.status, content_type=_JSON,
                                        headers={"X-Request-Id": s.request_id})
                return await self._respond_stream(request, s, ex)
            except ApiError as err:
                s.status = err.status
                return error_response(err, s.request_id)
            except asyncio.CancelledError:  # the client went away, or the drain timeout ran out (aiohttp cancels)
                if self.stopping:
                    s.status = 503
                    s.cancel("shutdown")
                else:
                    s.client_left()
                raise
            except Exception as exc:  # one bad request never takes the service down
                log.exception("request_failed", request_id=s.carried, error=str(exc))
                s.cancel("error")
                s.status = 500
                return error_response(ApiError(500, "internal error"), s.request_id)

    async def _respond_stream(self, request: web.Request, s: Served, ex: Exchange) -> web.StreamResponse:
        resp = web.StreamResponse(status=ex.status, headers={**sse.HEADERS, "X-Request-Id": s.request_id})
        closing: list[asyncio.TimerHandle] = []
        transport = request.transport
        if transport is not None:  # a client that stops reading for good loses its connection
            ex.on_too_slow = lambda: closing.append(
                asyncio.get_running_loop().call_later(self.slow_client_grace, transport.abort))
        try:
            await resp.prepare(request)
            failed = await self._stream(resp, ex)
            if failed is not None:  # the client saw 200, then an error event: count and log the error
                s.status = failed.status
                ex.failed_midway(failed)
        except ConnectionResetError:  # the client went away (as the stream began, or mid-stream)
            s.client_left()
        finally:
            for timer in closing:  # (a keep-alive connection serves the client's next request)
                timer.cancel()
        return resp

    @staticmethod
    async def _stream(resp: web.StreamResponse, ex: Exchange) -> ApiError | None:
        """Write the stream; the error that ended it (sent as a final error event), if one did."""
        failed = None
        try:
            while payloads := await ex.read():
                await resp.write(sse.events(payloads))
        except ApiError as err:  # mid-stream: the status line is gone, so a final error event
            failed = err
            await resp.write(sse.error_event(
                error_body(err.status, err.message, type=err.type, param=err.param, code=err.code)
            ))
        await resp.write(sse.DONE)
        await resp.write_eof()
        return failed

    # --- fleet, health, metrics -----------------------------------------------------------------

    async def models(self, _request: web.Request) -> web.Response:
        return web.json_response(models_list(self.view))

    async def model(self, request: web.Request) -> web.Response:
        model = request.match_info["model"]
        entry = model_entry(self.view, model)
        if entry is None:
            return error_response(ApiError(
                404, f"The model `{model}` does not exist: no active worker serves it (GET /v1/models lists "
                "those that do).", type="invalid_request_error", param="model", code="model_not_found"), None)
        return web.json_response(entry)

    async def workers(self, _request: web.Request) -> web.Response:
        body = workers_list(self.view)
        if self._fleet_info is not None:
            body.update(self._fleet_info())
        return web.json_response(body)

    async def health(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(self, _request: web.Request) -> web.Response:
        reasons = self._not_ready()
        if reasons:
            return web.json_response({"status": "not ready", "reasons": reasons}, status=503)
        return web.json_response({"status": "ready"})

    async def metrics_page(self, _request: web.Request) -> web.Response:
        return metrics_response(self.metrics.registry)
