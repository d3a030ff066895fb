"""The fleet as the OpenAI API lists it: ``/v1/models`` and ``/v1/workers`` bodies. Pure."""

from __future__ import annotations

from typing import Any

from infera_common.fleet import FleetView
from infera_common.schemas import WorkerStatus

OWNER = "infera"


def models_list(view: FleetView) -> dict[str, Any]:
    """OpenAI's model list: each model with at least one active worker."""
    created: dict[str, float] = {}
    for rec in view.workers():
        if rec.status == WorkerStatus.ACTIVE:
            created[rec.model] = min(created.get(rec.model, rec.started_at), rec.started_at)
    return {
        "object": "list",
        "data": [
            {"id": model, "object": "model", "created": int(ts), "owned_by": OWNER}
            for model, ts in sorted(created.items())
        ],
    }


def workers_list(view: FleetView) -> dict[str, Any]:
    """Every worker discovery knows (any status), as its full record."""
    return {"object": "list", "data": [rec.model_dump(mode="json") for rec in view.workers()]}
