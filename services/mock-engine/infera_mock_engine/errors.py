"""Error bodies in each engine's shape, and the middleware that turns failures into them.

vLLM:   {"error": {"message", "type", "param", "code"}}
SGLang: {"object": "error", "message", "type", "param", "code"}
"""

from __future__ import annotations

import json
import logging
from http import HTTPStatus
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from infera_mock_engine.engine_errors import RequestError
from infera_mock_engine.tokenizer import TemplateError

log = logging.getLogger("infera_mock_engine.errors")

_VLLM_TYPES = {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}
_SGLANG_TYPES = {400: "BadRequest", 404: "NotFound", 503: "ServiceUnavailable"}


def error_body(flavor: str, status: int, message: str, param: str | None = None,
               err_type: str | None = None) -> dict[str, Any]:
    if flavor == "vllm":
        err_type = err_type or _VLLM_TYPES.get(status, "InternalServerError")
        return {"error": {"message": message, "type": err_type, "param": param, "code": status}}
    err_type = err_type or _SGLANG_TYPES.get(status, "InternalServerError")
    return {"object": "error", "message": message, "type": err_type, "param": param, "code": status}


def error_response(flavor: str, status: int, message: str, param: str | None = None,
                   err_type: str | None = None) -> web.Response:
    body = json.dumps(error_body(flavor, status, message, param, err_type), ensure_ascii=False, separators=(",", ":"))
    return web.Response(text=body, status=status, content_type="application/json")


def stream_error_event(flavor: str, e: RequestError) -> dict[str, Any]:
    """The `data:` payload an OpenAI stream ends with when the generation failed after the stream began:
    vLLM `{"error": {message, type, param, code}}`; SGLang the same wrapping its ErrorResponse, typed with
    the HTTP status name (`INTERNAL_SERVER_ERROR`), as its serving_chat does for a scheduler abort."""
    if flavor == "vllm":
        return error_body(flavor, e.status, e.message, e.param, e.err_type)
    name = HTTPStatus(e.status).name if e.status in HTTPStatus._value2member_map_ else str(e.status)
    return {"error": error_body(flavor, e.status, e.message, e.param, name)}


def describe_validation(exc: ValidationError) -> tuple[str, str | None]:
    """A one-line message and the first offending field of a pydantic error."""
    parts = []
    param = None
    for err in exc.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()) if not str(x).startswith(("function-", "union[")))
        param = param or (loc or None)
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    return "; ".join(parts) or str(exc), param


#: set on a request whose streamed response has begun (``SseWriter.start``)
STREAM_STARTED = web.RequestKey("infera_mock_stream_started", bool)


def make_error_middleware(flavor: str):
    @web.middleware
    async def errors(request: web.Request, handler):
        try:
            return await handler(request)
        except RequestError as e:
            return error_response(flavor, e.status, e.message, e.param, e.err_type)
        except TemplateError as e:
            return error_response(flavor, 400, str(e), "messages")
        except ValidationError as e:
            message, param = describe_validation(e)
            return error_response(flavor, 400, message, param)
        except web.HTTPException:
            raise
        except ConnectionError:
            raise  # the client went away mid-response; nothing to answer
        except Exception as e:  # noqa: BLE001 - one bad request must not take the engine down
            log.exception("unhandled error on %s %s", request.method, request.path)
            if request.get(STREAM_STARTED):  # its head is gone: the connection breaks, as an engine's would
                if request.transport is not None:
                    request.transport.close()
                raise
            return error_response(flavor, 500, f"internal error: {type(e).__name__}: {e}")

    return errors
