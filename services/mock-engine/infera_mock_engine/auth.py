"""``--api-key``: requests must carry ``Authorization: Bearer <key>``, as each engine checks it.

- vLLM (``--api-key``, or the ``VLLM_API_KEY`` environment variable): every route except its public
  ones (``/health``, ``/ping``, ``/load``, ``/version``, ``/metrics``, and paths under them).
- SGLang (``--api-key``): every route except those whose path starts with ``/health`` (so
  ``/health_generate`` too) or ``/metrics``.

Both let ``OPTIONS`` through, read the scheme case-insensitively, and refuse with HTTP 401 and the
body ``{"error": "Unauthorized"}`` (not their usual error shapes).
"""

from __future__ import annotations

import hashlib
import hmac

from aiohttp import web

VLLM_PUBLIC = ("/health", "/ping", "/load", "/version", "/metrics")
SGLANG_PUBLIC_PREFIXES = ("/health", "/metrics")


def is_public(flavor: str, path: str) -> bool:
    if flavor == "vllm":
        return any(path == p or path.startswith(p + "/") for p in VLLM_PUBLIC)
    return path.startswith(SGLANG_PUBLIC_PREFIXES)


def bearer_matches(header: str | None, digest: bytes) -> bool:
    """Whether ``Authorization`` carries the key whose SHA-256 is ``digest`` (compared in constant time)."""
    if not header:
        return False
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest(), digest)


def make_auth_middleware(flavor: str, api_key: str):  # noqa: ANN201 - an aiohttp middleware
    digest = hashlib.sha256(api_key.encode()).digest()

    @web.middleware
    async def check_api_key(request: web.Request, handler) -> web.StreamResponse:  # noqa: ANN001
        if (request.method == "OPTIONS" or is_public(flavor, request.path)
                or bearer_matches(request.headers.get("Authorization"), digest)):
            return await handler(request)
        return web.json_response({"error": "Unauthorized"}, status=401)

    return check_api_key
