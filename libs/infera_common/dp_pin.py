"""Pinning a request to one data-parallel rank of an engine, the way each engine reads it. Pure.

SGLang reads ``routed_dp_rank`` in the body (older versions ``data_parallel_rank``); vLLM reads the
``X-data-parallel-rank`` header. The router sends both: each engine ignores the other's (SGLang's
and vLLM's request models accept unknown fields; headers they do not know are ignored).
"""

from __future__ import annotations

import json
from typing import Any

RANK_FIELD = "routed_dp_rank"
RANK_HEADER = "X-data-parallel-rank"


def pin_body(body: dict[str, Any], rank: int | None) -> dict[str, Any]:
    return body if rank is None else {**body, RANK_FIELD: rank}


def pin_bytes(body: bytes, rank: int | None, model: str | None = None) -> bytes:
    """The JSON body with the rank field, and ``model`` in place of the client's when given (an
    engine's own name for a LoRA adapter: ``WorkerRecord.engine_model``). Unchanged when there is
    neither, or when it is not a JSON object."""
    if rank is None and model is None:
        return body
    try:
        data = json.loads(body)
    except ValueError:
        return body
    if not isinstance(data, dict):
        return body
    if model is not None:
        data["model"] = model
    return json.dumps(pin_body(data, rank)).encode()


def rank_headers(rank: int | None) -> dict[str, str]:
    return {} if rank is None else {RANK_HEADER: str(rank)}
