"""Placing one attempt: the route request on the bus and the router's reply.

The route request goes out on ``ROUTER_ROUTE`` with the attempt's own inbox subject as its reply
subject; the router's ``RouteReply`` comes back to it, and so may the first frames of the worker
(they are kept) and the router's ``alive`` frames (a router waiting on a prefill before it can name
the decode worker). ``router_error`` turns a refusal into the client's error.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgpack
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from infera_common.answering import Wary, first_to_answer
from infera_common.schemas import RouteReply
from infera_common.subjects import ROUTER_PING, ROUTER_ROUTE, router_route_subject

from infera_frontend.inbox import Mailbox
from infera_frontend.validation import ApiError

#: Seconds between route requests while NATS says no router is subscribed (within --route-timeout).
NO_ROUTER_PAUSE = 0.25
#: Seconds to wait for a router to say it is there before a retry after a route timeout.
PING_TIMEOUT = 0.5

_ROUTER_ERROR_TYPES = {
    400: ("invalid_request_error", None),
    404: ("invalid_request_error", "model_not_found"),
    429: ("rate_limit_error", "rate_limit_exceeded"),
    503: ("service_unavailable_error", None),
}


def router_error(reply: RouteReply) -> ApiError:
    """The client's error for a router refusal (its status is passed through)."""
    status = reply.status if 400 <= reply.status < 600 else 500
    etype, code = _ROUTER_ERROR_TYPES.get(status, ("internal_server_error" if status >= 500 else None, None))
    message = reply.message or {
        404: "The model does not exist.",
        429: "Every worker for this model is at its pending limit; retry later.",
        503: "No active worker for this model.",
    }.get(status, f"the router could not place the request (status {reply.status})")
    param = "model" if status == 404 else None
    return ApiError(status, message, type=etype, param=param, code=code)


def router_unavailable() -> ApiError:
    return ApiError(503, "router unavailable", type="service_unavailable_error")


class NoRouter(Exception):
    """NATS answered the route request with 'no responders': no router is subscribed."""


def is_no_responders(msg: Msg) -> bool:
    return not msg.data and bool(msg.headers) and msg.headers.get("Status") == "503"


class Placement:
    """Route requests and their replies, with the frontend's ``--route-timeout`` and
    ``--upstream-timeout``."""

    def __init__(self, nc: NATS, route_timeout: float, upstream_timeout: float,
                 direct: Callable[[], None] | None = None) -> None:
        self._nc = nc
        self.route_timeout = route_timeout
        self.upstream_timeout = upstream_timeout
        self._direct = direct  # told of each route request sent to one router's own subject (a counter)
        self._wary = Wary()  # (on the loop's clock) after a route timeout: to a router that answers

    async def place(self, data: bytes, subject: str, box: Mailbox,
                    after_silence: bool = False) -> tuple[RouteReply, list[Msg]]:
        """Send the route request; while no router is subscribed (e.g. the routers are still
        reconnecting after a broker restart) send it again every ``NO_ROUTER_PAUSE`` seconds, up to
        ``--route-timeout``: nobody received it, so it cannot be placed twice.

        ``after_silence``: the request's previous attempt got no route reply. The routers' queue group
        hands each request to any of them, so half of the retries went to a silent router again (two
        routers, one frozen: 34 of 240 requests failed, the HA bench). So the retry goes to the first
        router that says it is there (``ROUTER_PING``), on its own subject; to the queue group when
        none does within ``PING_TIMEOUT`` (routers from before the ping answer nothing). So do the
        other requests for ``answering.WARY_FOR`` seconds after it: the silent router would take its
        share of them too, each waiting out the route timeout."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        deadline = now + self.route_timeout
        if after_silence:
            self._wary.silence(now)
        router = await first_to_answer(self._nc, ROUTER_PING, PING_TIMEOUT) if self._wary.active(now) else None
        if router is not None:
            if self._direct is not None:
                self._direct()
            await self._nc.publish(router_route_subject(router), data, reply=subject)
            try:
                return await self.reply(box, deadline)
            except NoRouter:  # it left in the meantime: the queue group, then
                pass
        while True:
            await self._nc.publish(ROUTER_ROUTE, data, reply=subject)
            try:
                return await self.reply(box, deadline)
            except NoRouter:
                if loop.time() + NO_ROUTER_PAUSE >= deadline:
                    raise
            await asyncio.sleep(NO_ROUTER_PAUSE)

    async def reply(self, box: Mailbox, deadline: float | None = None) -> tuple[RouteReply, list[Msg]]:
        """The router's reply (by ``deadline``, on the loop's clock; default ``--route-timeout`` from
        now), and any frames that arrived before it (kept in order). An ``alive`` frame (a router
        waiting on a prefill before it can name the decode worker) moves the deadline to
        ``--upstream-timeout`` from then: the router has answered, the engine's pace is what is left."""
        loop = asyncio.get_running_loop()
        if deadline is None:
            deadline = loop.time() + self.route_timeout
        early: list[Msg] = []
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TimeoutError
            msg = await box.get(remaining)
            if is_no_responders(msg):
                raise NoRouter
            try:
                raw = msgpack.unpackb(msg.data, raw=False)
            except Exception as exc:  # msgpack raises several unrelated types
                raise ValueError(f"not msgpack: {exc}") from exc
            if isinstance(raw, dict) and "kind" in raw:  # a worker's frame overtook the router's reply
                if raw["kind"] == "alive":
                    deadline = max(deadline, loop.time() + self.upstream_timeout)
                    continue
                early.append(msg)
                continue
            return RouteReply.model_validate(raw), early
