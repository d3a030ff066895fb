"""``--api-key``: HTTP clients must send ``Authorization: Bearer <key>`` (any of the keys given).

As the OpenAI API and the engines do it: the scheme is read case-insensitively, keys are compared
by their SHA-256 digests in constant time, and a refusal is HTTP 401 with an OpenAI error body
(``code`` ``invalid_api_key``) and ``WWW-Authenticate: Bearer``. Every route and method needs the key
except the probes that carry no secret: ``/health``, ``/ready`` and ``/metrics`` (Kubernetes probes
and Prometheus). ``OPTIONS`` too: the frontend serves no CORS preflight, and a keyless caller would
learn from its 405 or 404 which routes exist. Several keys are accepted at once so that a key can be replaced
without a window in which clients are refused. NATS clients are authenticated by the NATS server
(its users and permissions), not here.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Callable, Sequence

from aiohttp import web

from infera_common.openai_errors import error_body

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})


def digests(keys: Sequence[str]) -> tuple[bytes, ...]:
    return tuple(hashlib.sha256(k.encode()).digest() for k in keys)


def refusal(header: str | None, accepted: Sequence[bytes]) -> str | None:
    """Why a request with this ``Authorization`` header is refused, or None when it carries a key."""
    if not header:
        return "Missing API key: send it as the header 'Authorization: Bearer <key>'."
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        return "The Authorization header must read 'Bearer <key>'."
    # (aiohttp keeps bytes that are not UTF-8 as surrogates: encoded back, they simply do not match)
    digest = hashlib.sha256(token.strip().encode("utf-8", "surrogateescape")).digest()
    matched = False
    for key in accepted:  # every key compared, so the time does not tell which one nearly matched
        matched |= hmac.compare_digest(digest, key)
    return None if matched else "Incorrect API key provided."


def make_auth_middleware(keys: Sequence[str], on_refused: Callable[[], None]):  # noqa: ANN201 - aiohttp middleware
    accepted = digests(keys)

    @web.middleware
    async def check_api_key(request: web.Request, handler) -> web.StreamResponse:  # noqa: ANN001
        if request.path not in OPEN_PATHS:
            why = refusal(request.headers.get("Authorization"), accepted)
            if why is not None:
                on_refused()
                body = error_body(401, why, type="invalid_request_error", code="invalid_api_key")
                return web.Response(body=json.dumps(body).encode(), status=401, content_type="application/json",
                                    headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    return check_api_key
