"""An in-process stand-in for an engine's HTTP API, scripted per request by a ``mode`` in the body."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web
from aiohttp.test_utils import TestServer


class FakeEngine:
    def __init__(self) -> None:
        self.requests: list[dict] = []  # {"path", "headers", "body"} of every request received
        self.aborts: list[str] = []
        self.cancelled: list[str] = []  # request ids whose connection the client closed mid-answer
        self.server: TestServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return str(self.server.make_url("")).rstrip("/")

    async def start(self) -> "FakeEngine":
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/abort_request", self._abort)
        self.server = TestServer(app, host="127.0.0.1")
        await self.server.start_server()
        return self

    async def close(self) -> None:
        if self.server is not None:
            await self.server.close()

    async def _abort(self, request: web.Request) -> web.Response:
        self.aborts.append((await request.json())["rid"])
        return web.json_response({})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        rid = request.headers.get("X-Request-Id", "")
        self.requests.append({"path": request.path, "headers": {k.lower(): v for k, v in request.headers.items()}, "body": raw})
        body = json.loads(raw)
        mode = body.get("mode", "stream" if body.get("stream") else "json")
        n = int(body.get("events", 3))
        delay = float(body.get("delay", 0.0))
        if mode == "json":
            await asyncio.sleep(delay)  # a long generation: nothing is sent until the whole answer
            return web.json_response({"id": rid, "choices": [{"text": "hello"}]})
        if mode == "status":
            return web.json_response({"error": {"message": "nope"}}, status=int(body["status"]))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for i in range(n):
                await asyncio.sleep(delay)
                await resp.write(f'data: {{"i": {i}}}\n\n'.encode())
            if mode == "drop":
                request.transport.close()  # die mid-stream: no terminating chunk
                return resp
            if mode == "hang":
                await asyncio.sleep(3600)
            await resp.write(b"data: [DONE]\n\n")
        except (asyncio.CancelledError, ConnectionResetError):
            self.cancelled.append(rid)
            raise
        return resp
