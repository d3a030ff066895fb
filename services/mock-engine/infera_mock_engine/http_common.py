"""Helpers shared by the API modules: the app's engine, request ids, JSON bodies, SSE framing."""

from __future__ import annotations

import json
import uuid
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from infera_mock_engine.engine import Engine, RequestError
from infera_mock_engine.errors import STREAM_STARTED

ENGINE = web.AppKey("engine", Engine)
M = TypeVar("M", bound=BaseModel)


def engine_of(request: web.Request) -> Engine:
    return request.app[ENGINE]


def require_ready(engine: Engine) -> None:
    if not engine.ready.is_set():
        raise RequestError("the engine is starting up", status=503)


async def parse_body(request: web.Request, model: type[M]) -> M:
    raw = await request.read()
    try:  # pydantic's own parser in one pass: a third of json.loads + validate on a long token-id prompt
        return model.model_validate_json(raw)
    except ValidationError:
        pass  # the reference path below says why (or accepts what only json.loads reads, e.g. a UTF-16 body)
    try:
        data = json.loads(raw or b"null")
    except ValueError as e:  # bad JSON or bad UTF-8
        raise RequestError(f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise RequestError("the request body must be a JSON object")
    return model.model_validate(data)


def request_id(request: web.Request, *body_ids: str | None) -> str:
    """The request's id: a body id (SGLang `rid`, vLLM `request_id`), else X-Request-Id, else a new one."""
    for rid in body_ids:
        if rid:
            return rid
    return request.headers.get("X-Request-Id") or uuid.uuid4().hex


_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))  # json.dumps would build one per call


def dumps(obj: Any) -> bytes:
    return _ENCODER.encode(obj).encode()


class SseWriter:
    """`data: {json}\\n\\n` frames, then `data: [DONE]\\n\\n`."""

    def __init__(self, request: web.Request, rid: str) -> None:
        self.request = request
        self.response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **id_header(rid)}
        )

    async def start(self) -> None:
        self.request[STREAM_STARTED] = True
        await self.response.prepare(self.request)

    async def send(self, obj: Any) -> None:
        await self.send_json(dumps(obj))

    async def send_json(self, payload: bytes) -> None:
        """Send a frame whose JSON is already encoded (`sse_frames`)."""
        await self.response.write(b"data: " + payload + b"\n\n")

    async def done(self) -> web.StreamResponse:
        await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()
        return self.response


def id_header(rid: str | None) -> dict[str, str]:
    """The X-Request-Id echo of a request id, when it can be a header value (a body `rid` may hold
    anything JSON does, control characters included: then the id is in the body only)."""
    return {"X-Request-Id": rid} if rid and rid.isascii() and rid.isprintable() else {}


def json_response(obj: Any, rid: str | None = None, status: int = 200) -> web.Response:
    headers = id_header(rid) or None
    return web.Response(body=dumps(obj), status=status, content_type="application/json", headers=headers)
