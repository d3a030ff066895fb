"""Server-sent events framing, exactly as OpenAI and the engines frame a stream."""

from __future__ import annotations

import json
from typing import Any

DONE = b"data: [DONE]\n\n"

HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


def events(payloads: list[bytes]) -> bytes:
    """``data: <payload>\\n\\n`` for each JSON payload, as one buffer."""
    if len(payloads) == 1:
        return b"data: " + payloads[0] + b"\n\n"
    return b"".join(b"data: " + p + b"\n\n" for p in payloads)


def error_event(error: dict[str, Any]) -> bytes:
    """The final event of a stream that failed midway: ``data: {"error": {...}}``."""
    return b"data: " + json.dumps(error).encode() + b"\n\n"
