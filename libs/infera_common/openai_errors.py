"""Errors in the OpenAI shape: ``{"error": {"message", "type", "param", "code"}}``.

Pure helpers, no web framework: build an error body for a status, and convert whatever an engine
answered with (OpenAI-shaped, FastAPI ``{"detail": ...}``, SGLang ``{"message": ...}``, plain
text) into the OpenAI shape.
"""

from __future__ import annotations

import json
from typing import Any

#: The OpenAI error ``type`` for an HTTP status (the nearest of OpenAI's own names).
_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    502: "bad_gateway_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


def error_type(status: int) -> str:
    if status in _TYPE_BY_STATUS:
        return _TYPE_BY_STATUS[status]
    return "invalid_request_error" if 400 <= status < 500 else "internal_server_error"


def error_body(
    status: int,
    message: str,
    type: str | None = None,  # noqa: A002 - OpenAI's field name
    param: str | None = None,
    code: str | int | None = None,
) -> dict[str, Any]:
    """The OpenAI error object for ``status``; ``type`` defaults from the status."""
    return {"error": {"message": message, "type": type or error_type(status), "param": param, "code": code}}


def error_json(status: int, message: str, **kw: Any) -> bytes:
    return json.dumps(error_body(status, message, **kw)).encode()


def is_openai_error(obj: Any) -> bool:
    return (
        isinstance(obj, dict)
        and isinstance(obj.get("error"), dict)
        and isinstance(obj["error"].get("message"), str)
    )


def _message_of(obj: Any) -> str | None:
    """The human message of a non-OpenAI error body, when one can be found."""
    if isinstance(obj, str):
        return obj
    if not isinstance(obj, dict):
        return None
    for key in ("message", "detail", "error", "msg"):
        value = obj.get(key)
        if isinstance(value, str) and value:
            return value
        if isinstance(value, dict):
            inner = _message_of(value)
            if inner:
                return inner
        if isinstance(value, list) and value:  # FastAPI validation errors: [{"msg": ...}, ...]
            parts = [m for v in value if (m := _message_of(v))]
            if parts:
                return "; ".join(parts)
    return None


def normalize_error(status: int, body: bytes) -> bytes:
    """An engine's error body as OpenAI error JSON: kept verbatim if already OpenAI-shaped.

    ``body`` is raw bytes (JSON or text). The result always parses as ``{"error": {...}}``.
    """
    text = body.decode("utf-8", errors="replace").strip()
    try:
        obj = json.loads(text) if text else None
    except ValueError:
        obj = None
    if is_openai_error(obj):
        err = obj["error"]
        if all(k in err for k in ("type", "param", "code")):
            return body
        return json.dumps(error_body(status, err["message"], type=err.get("type"), param=err.get("param"),
                                     code=err.get("code"))).encode()
    message = _message_of(obj) if obj is not None else (text or None)
    if obj is not None and message is None:
        message = text
    kw: dict[str, Any] = {}
    if isinstance(obj, dict):  # vLLM/SGLang ErrorResponse: {"object": "error", "message", "type", "param", "code"}
        if isinstance(obj.get("type"), str):
            kw["type"] = obj["type"]
        if isinstance(obj.get("param"), str):
            kw["param"] = obj["param"]
        if isinstance(obj.get("code"), (str, int)):
            kw["code"] = obj["code"]
    return error_json(status, message or f"upstream error (HTTP {status})", **kw)
