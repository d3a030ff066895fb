"""The fleet as the OpenAI API lists it: ``/v1/models``, ``/v1/models/{model}`` and ``/v1/workers``
bodies. Pure."""

from __future__ import annotations

from typing import Any

from infera_common.fleet import FleetView
from infera_common.schemas import WorkerStatus

OWNER = "infera"


def _served(view: FleetView) -> dict[str, dict[str, Any]]:
    """Each model (a worker's model, alias or LoRA adapter) with at least one active worker: its model object (``created``: when its earliest
    such worker started; ``max_model_len``, as vLLM lists it: the longest context length among them,
    when every one of them said)."""
    models: dict[str, dict[str, Any]] = {}
    lengths: dict[str, list[int | None]] = {}
    for rec in view.workers():
        if rec.status != WorkerStatus.ACTIVE:
            continue
        for name in rec.served_names:  # an alias is listed as a model of its own, as vLLM lists it
            entry = models.setdefault(name, {"id": name, "object": "model", "created": int(rec.started_at),
                                             "owned_by": OWNER})
            if rec.adapter(name):  # a LoRA adapter names its base model, as vLLM lists it
                entry["parent"] = rec.model
            entry["created"] = min(entry["created"], int(rec.started_at))
            lengths.setdefault(name, []).append(rec.context_length)
    for model, said in lengths.items():
        if None not in said:
            models[model]["max_model_len"] = max(said)  # type: ignore[type-var]
    return models


def models_list(view: FleetView) -> dict[str, Any]:
    """OpenAI's model list: each model with at least one active worker."""
    return {"object": "list", "data": [entry for _, entry in sorted(_served(view).items())]}


def model_entry(view: FleetView, model: str) -> dict[str, Any] | None:
    """OpenAI's model object (``GET /v1/models/{model}``), as ``models_list`` lists it; None when not listed."""
    return _served(view).get(model)


def workers_list(view: FleetView) -> dict[str, Any]:
    """Every worker discovery knows (any status), as its full record."""
    return {"object": "list", "data": [rec.model_dump(mode="json") for rec in view.workers()]}
