"""Builders shared by the router tests (plain functions, no fixtures)."""

from __future__ import annotations

import time

from infera_common.fleet import Change
from infera_common.block_hash import pack_tokens
from infera_common.schemas import Endpoint, LoadReport, RouteRequest, WorkerRecord, WorkerStatus


def record(wid: str, model: str = "m", status: WorkerStatus = WorkerStatus.ACTIVE, **kw) -> WorkerRecord:
    kw.setdefault("url", "http://127.0.0.1:1")
    return WorkerRecord(worker_id=wid, model=model, engine="mock", advertise_host="127.0.0.1", status=status, **kw)


def join(wid: str, model: str = "m", status: WorkerStatus = WorkerStatus.ACTIVE, **kw) -> Change:
    return Change("join", record(wid, model, status, **kw))


def update(wid: str, model: str = "m", status: WorkerStatus = WorkerStatus.ACTIVE) -> Change:
    return Change("update", record(wid, model, status))


def leave(wid: str, model: str = "m", **kw) -> Change:
    return Change("leave", record(wid, model, **kw))


def route_request(model: str = "m", request_id: str = "r", prompt_tokens: int = 0,
                  exclude: list[str] | None = None, body: bytes = b'{"x":1}',
                  token_ids: list[int] | None = None, reply_subject: str = "_INBOX.test.1", **kw) -> RouteRequest:
    return RouteRequest(request_id=request_id, model=model, endpoint=Endpoint.CHAT, body=body,
                        reply_subject=reply_subject, deadline=time.time() + 60,
                        prompt_tokens=prompt_tokens, exclude=exclude or [],
                        tokens=None if token_ids is None else pack_tokens(token_ids), **kw)


def load(wid: str, in_flight: int = 0, waiting: int = 0, kv: float = 0.0, **fields) -> LoadReport:
    return LoadReport(worker_id=wid, in_flight=in_flight, engine_waiting=waiting, kv_usage=kv, **fields)
