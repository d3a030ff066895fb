"""Errors in the OpenAI shape: ``{"error": {"message", "type", "param", "code"}}``.

Pure helpers, no web framework: build an error body for a status, and convert whatever an engine
answered with (OpenAI-shaped, FastAPI ``{"detail": ...}``, SGLang ``{"message": ...}``, plain
text) into the OpenAI shape, with OpenAI's kind of ``type`` and ``code``: the engines name the
type after an exception or status class (vLLM ``BadRequestError``, SGLang ``BadRequest``,
``INTERNAL_SERVER_ERROR``) and repeat the HTTP status as an integer ``code``; clients behind one
endpoint get ``invalid_request_error`` and friends, and a string code or null, whatever engine
answered.
"""

from __future__ import annotations

import json
import re
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


#: OpenAI's spelling of an error type (``invalid_request_error``); an engine's that is not is replaced.
_OPENAI_TYPE = re.compile(r"[a-z][a-z0-9_]*_error")


def _openai_type(status: int, engine_type: Any) -> str:
    return engine_type if isinstance(engine_type, str) and _OPENAI_TYPE.fullmatch(engine_type) else error_type(status)


def _openai_code(status: int, code: Any) -> str | None:
    """A string code as given; an engine's integer code (its HTTP status, as a rule) as null when it
    only repeats ``status``, else as a string."""
    if isinstance(code, bool) or code is None:
        return None
    if isinstance(code, int):
        return None if code == status else str(code)
    return code if isinstance(code, str) else None


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


def error_message(status: int, body: bytes) -> str:
    """The human message of an engine's error answer (``body``: JSON of any known shape, or text)."""
    return json.loads(normalize_error(status, body))["error"]["message"]


def _param(param: Any) -> str | None:
    """The request field an engine's error names, as OpenAI names it: FastAPI's validation errors
    (vLLM's "N validation errors") say where in the request, ``body.stop``; the field is ``stop``."""
    if not isinstance(param, str):
        return None
    return param.removeprefix("body.") or None


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
        etype, code = _openai_type(status, err.get("type")), _openai_code(status, err.get("code"))
        param = _param(err.get("param"))
        if err.get("type") == etype and err.get("code") == code and "param" in err and err["param"] == param:
            return body
        return json.dumps(error_body(status, err["message"], type=etype, param=param, code=code)).encode()
    message = _message_of(obj) if obj is not None else (text or None)
    if obj is not None and message is None:
        message = text
    kw: dict[str, Any] = {}
    if isinstance(obj, dict):  # vLLM/SGLang ErrorResponse: {"object": "error", "message", "type", "param", "code"}
        kw["type"] = _openai_type(status, obj.get("type"))
        if isinstance(obj.get("param"), str):
            kw["param"] = _param(obj["param"])
        kw["code"] = _openai_code(status, obj.get("code"))
    return error_json(status, message or f"upstream error (HTTP {status})", **kw)
