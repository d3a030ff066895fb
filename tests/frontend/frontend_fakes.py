"""Test helpers for the frontend: a fake router + worker-agent on real NATS, request bodies.

The fake follows the request-plane contract (docs/architecture.md): it answers ``RouteRequest``s on
``ROUTER_ROUTE`` with a ``RouteReply`` and then, as the worker-agent would, publishes ``Frame``s to
the request's ``reply_subject``: a non-streaming answer is one final ``head`` (``final=True``, the
whole body, nothing after it); a stream is ``head``, ``data`` (one SSE payload each) and ``end``. It records every route request and every ``Cancel`` it receives.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from infera_common.schemas import (
    Cancel,
    Frame,
    FramesQuery,
    FramesReplay,
    FramesReplayed,
    FramesSent,
    RouteReply,
    RouteRequest,
    WorkerRecord,
    WorkerStatus,
    decode,
    encode,
)
from infera_common.answering import ping_answerer
from infera_common.nats_conn import flush_all
from infera_common.subjects import ROUTER_PING, router_route_subject
from infera_frontend.service import Frontend
from tests.waiting import eventually

MODEL = "SmolLM2-135M-Instruct"
WORKER = "w1"


def chat_body(content: str = "1+1=?", **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


def completion_json(text: str = "2") -> bytes:
    return json.dumps({
        "id": "cmpl-1", "object": "chat.completion", "created": 1, "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 35, "completion_tokens": 1, "total_tokens": 36},
    }).encode()


def chunk_json(i: int, text: str) -> bytes:
    return json.dumps({
        "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
        "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}],
    }).encode()


STREAM_TEXTS = ["Two", ",", " of course"]
W1, W2, W3 = "w1", "w2", "w3"  # MultiFleet's workers (the ``multi`` fixture)

Script = Callable[["FakeFleet", RouteRequest], Awaitable[None]]  # what the "worker" sends back


async def script_ok(fleet: FakeFleet, req: RouteRequest) -> None:
    """A well-behaved engine: the whole body, or a three-chunk stream."""
    if not req.stream:
        await fleet.frame(req, Frame(kind="head", status=200, body=completion_json(), final=True))
        return
    await fleet.frame(req, Frame(kind="head", status=200))
    for i, text in enumerate(STREAM_TEXTS):
        await fleet.frame(req, Frame(kind="data", seq=i + 1, body=chunk_json(i, text)))
    await fleet.frame(req, Frame(kind="end", seq=len(STREAM_TEXTS) + 1))


async def script_silent(fleet: FakeFleet, req: RouteRequest) -> None:
    """The engine never answers."""


async def script_stall_after_first_chunk(fleet: FakeFleet, req: RouteRequest) -> None:
    await fleet.frame(req, Frame(kind="head", status=200))
    await fleet.frame(req, Frame(kind="data", seq=1, body=chunk_json(0, "Two")))


@dataclass
class FakeFleet:
    nc: object
    route_status: int = 200
    route_message: str = ""
    script: Script = script_ok
    route_silent: bool = False  # the router never answers
    frames_before_reply: bool = False
    routed: list[RouteRequest] = field(default_factory=list)
    cancels: list[tuple[float, str]] = field(default_factory=list)  # (monotonic time, request_id)
    cancel_msgs: dict[str, Cancel] = field(default_factory=dict)  # request_id -> the last Cancel
    tasks: set = field(default_factory=set)

    async def frame(self, req: RouteRequest, frame: Frame) -> None:
        await self.nc.publish(req.reply_subject, encode(frame))

    async def on_route(self, msg) -> None:
        req = decode(RouteRequest, msg.data)
        self.routed.append(req)
        if self.route_status != 200:
            await msg.respond(encode(RouteReply(status=self.route_status, message=self.route_message)))
            return
        if self.route_silent:
            return
        ok = encode(RouteReply(status=200, worker_id=WORKER, lease_id="lease-1", router_id="r1"))
        if self.frames_before_reply:  # the worker overtakes the router's reply
            await self.script(self, req)
            await self.nc.flush()
            await msg.respond(ok)
            return
        await msg.respond(ok)
        task = asyncio.get_running_loop().create_task(self.script(self, req))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def on_cancel(self, msg) -> None:
        cancel = decode(Cancel, msg.data)
        self.cancels.append((time.monotonic(), cancel.request_id))
        self.cancel_msgs[cancel.request_id] = cancel

    async def wait_cancel(self, request_id: str, timeout: float) -> float | None:
        """Monotonic time the Cancel for ``request_id`` arrived, or None within ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for t, rid in self.cancels:
                if rid == request_id:
                    return t
            await asyncio.sleep(0.01)
        return None


def worker_record(worker_id: str = WORKER, model: str = MODEL, status=WorkerStatus.ACTIVE,
                  context_length: int | None = None) -> WorkerRecord:
    return WorkerRecord(worker_id=worker_id, model=model, engine="mock", url="http://127.0.0.1:1",
                        advertise_host="127.0.0.1", status=status, ttl=6.0, context_length=context_length)


wait_until = eventually


def url(fe: Frontend, path: str) -> str:
    return f"http://127.0.0.1:{fe.port}{path}"


@dataclass
class MultiFleet:
    """A fake router over several fake workers: it honours ``RouteRequest.exclude`` (first worker of
    ``workers`` not excluded; 503 when none is left) and each worker answers with its own script."""

    nc: object
    workers: list[str]
    scripts: dict[str, Script] = field(default_factory=dict)  # worker id -> script (default: script_ok)
    routed: list[RouteRequest] = field(default_factory=list)
    placed: list[str] = field(default_factory=list)  # the worker of each placed attempt, in order
    cancels: list[tuple[str, str]] = field(default_factory=list)  # (worker id, request id)
    sent: dict[str, int] = field(default_factory=dict)  # request id -> frames a worker says it sent
    kept: dict[str, list[tuple[str, bytes]]] = field(default_factory=dict)  # request id -> (subject, frame) sent
    keeps_frames: bool = True  # False: the workers answer FramesReplay with -1 (no longer kept)
    replays: list[tuple[str, int]] = field(default_factory=list)  # (request id, from_seq) asked
    frames_from: str | None = "worker"  # "router": the router sends the frames; None: a router before the field
    asked: list[tuple[str, str | None]] = field(default_factory=list)  # (subject, worker id) of each question
    query_subs: dict[str, object] = field(default_factory=dict)  # sender -> its FramesQuery subscription
    tasks: set = field(default_factory=set)
    before_reply: Script | None = None  # what the router does before it replies (say, wait on a prefill)
    stalled: int = 0  # route requests still to be taken in and never answered (a frozen router's share)
    direct: list[str] = field(default_factory=list)  # ids of the route requests sent to a router's own subject

    async def frame(self, req: RouteRequest, frame: Frame, *, lost: bool = False) -> None:
        """Send a frame (``lost``: count and keep it as sent, but it never reaches the frontend)."""
        data = encode(frame)
        self.kept.setdefault(req.request_id, []).append((req.reply_subject, data))
        if lost:
            self.sent[req.request_id] = len(self.kept[req.request_id])
        else:
            await self.nc.publish(req.reply_subject, data)

    def frames_handler(self, worker_id: str):
        """Answer ``FramesQuery`` as a worker-agent does, from ``sent`` (unknown requests left out)."""
        async def on_query(msg) -> None:
            query = decode(FramesQuery, msg.data)
            self.asked.append((msg.subject, query.worker_id))
            ids = query.request_ids
            await msg.respond(encode(FramesSent(sent={r: self.sent[r] for r in ids if r in self.sent})))
        return on_query

    def replay_handler(self, worker_id: str):
        """Answer ``FramesReplay`` as a worker-agent does: the frames again, then how many."""
        async def on_replay(msg) -> None:
            ask = decode(FramesReplay, msg.data)
            self.asked.append((msg.subject, ask.worker_id))
            self.replays.append((ask.request_id, ask.from_seq))
            frames = self.kept.get(ask.request_id, [])[ask.from_seq:] if self.keeps_frames else None
            for subject, data in frames or ():
                await self.nc.publish(subject, data)
            await msg.respond(encode(FramesReplayed(count=-1 if frames is None else len(frames))))
        return on_replay

    async def on_route(self, msg) -> None:
        req = decode(RouteRequest, msg.data)
        self.routed.append(req)
        if self.stalled:
            self.stalled -= 1
            return
        await self._place(msg, req)

    async def serve_directly(self, router_id: str) -> None:
        """Be also a router that answers ``ROUTER_PING`` as ``router_id`` and takes route requests on
        its own subject (never stalled: ``stalled`` is the queue group's silent router)."""
        async def on_direct(msg) -> None:
            req = decode(RouteRequest, msg.data)
            self.routed.append(req)
            self.direct.append(req.request_id)
            await self._place(msg, req)

        await self.nc.subscribe(ROUTER_PING, cb=ping_answerer(router_id))
        await self.nc.subscribe(router_route_subject(router_id), cb=on_direct)
        await flush_all(self.nc)

    async def _place(self, msg, req: RouteRequest) -> None:
        left = [w for w in self.workers if w not in req.exclude]
        if not left:
            await msg.respond(encode(RouteReply(status=503, message="every worker of the model is excluded")))
            return
        worker = left[0]
        self.placed.append(worker)
        if self.before_reply is not None:
            await self.before_reply(self, req)
        await msg.respond(encode(RouteReply(status=200, worker_id=worker, lease_id=f"lease-{len(self.placed)}",
                                            router_id="r1", frames_from=self.frames_from)))
        script = self.scripts.get(worker, script_ok)
        task = asyncio.get_running_loop().create_task(script(self, req))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def cancel_handler(self, worker_id: str):
        async def on_cancel(msg) -> None:
            self.cancels.append((worker_id, decode(Cancel, msg.data).request_id))
        return on_cancel
