"""The fleet as the OpenAI API lists it: ``/v1/models``, ``/v1/models/{model}`` and ``/v1/workers``
bodies. Pure."""

from __future__ import annotations

from typing import Any

from infera_common.fleet import FleetView
from infera_common.schemas import WorkerStatus

OWNER = "infera"


def _served(view: FleetView) -> dict[str, float]:
    """Each model with at least one active worker: when its earliest such worker started."""
    created: dict[str, float] = {}
    for rec in view.workers():
        if rec.status == WorkerStatus.ACTIVE:
            created[rec.model] = min(created.get(rec.model, rec.started_at), rec.started_at)
    return created


def _model(model: str, started: float) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": int(started), "owned_by": OWNER}


def models_list(view: FleetView) -> dict[str, Any]:
    """OpenAI's model list: each model with at least one active worker."""
    return {"object": "list", "data": [_model(model, ts) for model, ts in sorted(_served(view).items())]}


def model_entry(view: FleetView, model: str) -> dict[str, Any] | None:
    """OpenAI's model object (``GET /v1/models/{model}``), as ``models_list`` lists it; None when not listed."""
    started = _served(view).get(model)
    return None if started is None else _model(model, started)


def workers_list(view: FleetView) -> dict[str, Any]:
    """Every worker discovery knows (any status), as its full record."""
    return {"object": "list", "data": [rec.model_dump(mode="json") for rec in view.workers()]}
