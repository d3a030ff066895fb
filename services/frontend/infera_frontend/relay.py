"""Routing one attempt of a request; the same for HTTP and NATS clients.

``Relay.open`` publishes a ``RouteRequest`` (``placement.py``) with the attempt's own inbox
subject (``inbox.py``) both as the NATS reply subject (for the router's ``RouteReply``) and as
``reply_subject`` (for the worker's ``Frame``s). Frames that overtake the router's reply are kept.
It returns an ``Exchange`` (``exchange.py``) that reads the worker's frames. Router refusals and
an unreachable router surface as ``ApiError``; ``publish_cancel`` sends ``Cancel`` to a worker.

``resync`` runs after every reconnect to the broker: frames a worker published while this frontend
was away (or that a restarting broker held) are lost, and so is an envelope still in the queue of
a broker that restarted. Core NATS does not say so; the sender does: whoever sends an open
request's frames (its worker-agent; on ``--request-transport http`` the router that calls the
engine, named by the route reply's ``frames_from``) is asked (``FramesQuery``) how many it sent. A
request short of them after a grace for frames still on their way asks for them again
(``Exchange.fill_gap``, ``ask_replay``); one its worker does not know ends with the loss
(``Exchange.lose``: retried on another worker while its client has nothing of it) instead of
waiting ``--upstream-timeout`` for frames that will not come.

``check_silent`` runs twice a second: the sender of each request that has received nothing for a
while is asked the same question; a sender the broker says has no subscription any more died with
its requests (``sender_watch.py``): those that have received nothing end at once, the others once
it has stayed away for a few seconds (it may be reconnecting, and their streams would go on).
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence

import nats.errors
from nats.aio.client import Client as NATS
from pydantic import BaseModel

from infera_common.block_hash import pack_tokens
from infera_common.logs import get_logger
from infera_common.nats_conn import RepeatedErrors
from infera_common.schemas import (
    Cancel, DiscoveryBackend, Endpoint, FramesQuery, FramesReplay, FramesReplayed, FramesSent, M, Release,
    RouteRequest, decode, encode,
)
from infera_common.subjects import (
    cancel_subject, frames_query_subject, frames_replay_subject, router_frames_query_subject,
    router_frames_replay_subject, router_release_subject,
)
from infera_common.tasks import stop_tasks

from infera_frontend.exchange import Exchange
from infera_frontend.failover import NO_ROUTER, ROUTE_TIMEOUT, SENDER_GONE, UPSTREAM_TIMEOUT, RetryableError
from infera_frontend.inbox import Inbox, Mailbox
from infera_frontend.metrics import FrontendMetrics
from infera_frontend.placement import NoRouter, Placement, router_error, router_unavailable
from infera_frontend.sender_watch import SenderWatch
from infera_frontend.token_check import TokenChecker, reported_prompt_tokens
from infera_frontend.validation import ApiError

log = get_logger("frontend.relay")

#: After a reconnect, a worker's answer to ``FramesQuery`` is awaited this long per try, and tried
#: again every ``RESYNC_RETRY`` seconds while nobody answers (its agent may reconnect after us).
FRAMES_QUERY_TIMEOUT = 2.0
RESYNC_RETRY = 0.5
RESYNC_ATTEMPTS = 20
#: ``alive`` frames a worker is asked for per ``--upstream-timeout`` while an answer has not begun.
KEEPALIVES_PER_TIMEOUT = 3
#: Frames a worker says it sent may still be on their way here: how long they get before they count as lost.
IN_TRANSIT_GRACE = 0.5
#: A placed request that received no frame for ``SILENT_AFTER`` seconds (``UNHEARD_AFTER`` when it
#: has received none at all) has its sender asked whether it is still on the bus
#: (``sender_watch.py``); the check runs every ``SENDER_CHECK_EVERY`` seconds and a question waits
#: ``SENDER_QUESTION_TIMEOUT`` for its answer. At the first "no responders" the requests that have
#: received nothing end; the others once their sender has answered so for ``SENDER_GONE_AFTER`` seconds.
SILENT_AFTER = 2.0
UNHEARD_AFTER = 0.5
SENDER_CHECK_EVERY = 0.5
SENDER_QUESTION_TIMEOUT = 1.0
SENDER_GONE_AFTER = 3.0
#: Seconds between two ``router_unavailable`` lines of one cause (a stalled router fails every request
#: it was handed).
ROUTER_ERRORS_LOG_EVERY = 10.0


def frames_subjects(router_id: str | None, worker_id: str) -> tuple[str, str]:
    """Where to ask about a request's frames (query, replay): the router that sends them
    (``router_id``), else the worker's agent."""
    if router_id is not None:
        return router_frames_query_subject(router_id), router_frames_replay_subject(router_id)
    return frames_query_subject(worker_id), frames_replay_subject(worker_id)


def frames_query(router_id: str | None, worker_id: str, exchanges: list[Exchange]) -> tuple[str, FramesQuery]:
    """The question to the sender of ``exchanges`` (all of ``worker_id``): how many frames each was sent."""
    query = FramesQuery(request_ids=[e.request_id for e in exchanges], worker_id=worker_id)
    return frames_subjects(router_id, worker_id)[0], query


def by_sender(exchanges: Iterable[Exchange]) -> dict[tuple[str | None, str], list[Exchange]]:
    """``exchanges`` grouped by who sends their frames (``Exchange.sender``): one question each."""
    groups: dict[tuple[str | None, str], list[Exchange]] = defaultdict(list)
    for exchange in exchanges:
        groups[exchange.sender].append(exchange)
    return groups


class Relay:
    def __init__(
        self, nc: NATS, inbox: Inbox, metrics: FrontendMetrics, *, route_timeout: float, upstream_timeout: float,
        request_timeout: float, discovery_backend: DiscoveryBackend | None = None,
    ) -> None:
        self._nc = nc
        self.discovery_backend = discovery_backend  # told to the router, which refuses if it watches another
        self.inbox = inbox
        self.metrics = metrics
        self.route_timeout = route_timeout
        self.upstream_timeout = upstream_timeout
        self.request_timeout = request_timeout
        self._placement = Placement(nc, route_timeout, upstream_timeout, metrics.routes_direct.inc)
        self._background: set[asyncio.Task] = set()
        self._open: set[Exchange] = set()  # placed requests whose exchange is not closed yet
        self.token_checker = TokenChecker()
        self.watch = SenderWatch(SILENT_AFTER, SENDER_GONE_AFTER, UNHEARD_AFTER)
        self._asking: set[tuple[str | None, str]] = set()  # senders being asked right now
        self._watch_task: asyncio.Task | None = None
        self._router_errors = RepeatedErrors(ROUTER_ERRORS_LOG_EVERY)

    def spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def drain_background(self) -> None:
        if self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    def check_usage(self, worker_id: str, request_id: str, expected: int, payload: bytes) -> bool:
        """Compare the engine's usage in ``payload`` (if any) with ``expected``; True when usage was found.

        A mismatch is counted every time and logged once per worker.
        """
        reported = reported_prompt_tokens(payload)
        if reported is None:
            return False
        bad, first = self.token_checker.mismatch(worker_id, expected, reported)
        if bad:
            self.metrics.token_mismatch.labels(worker_id).inc()
            if first:
                log.warning("token_mismatch", worker_id=worker_id, request_id=request_id,
                            frontend_prompt_tokens=expected, engine_prompt_tokens=reported,
                            hint="the engine tokenizes differently (model, tokenizer or chat template): "
                                 "KV-aware routing hashes the wrong ids; logged once per worker, counted always")
        return True

    def publish_cancel(self, worker_id: str, request_id: str, reason: str, lease_id: str = "") -> None:
        self.metrics.cancels.labels(reason).inc()
        self.spawn(self._publish_cancel(worker_id, request_id, reason, lease_id))

    async def _publish_cancel(self, worker_id: str, request_id: str, reason: str, lease_id: str) -> None:
        if reason == UPSTREAM_TIMEOUT:  # the worker's fault: its router's circuit breaker counts it
            cancel = Cancel(request_id=request_id, status=504, worker_fault=True, lease_id=lease_id,
                            message=f"nothing from the worker for {self.upstream_timeout:g}s")
        else:
            cancel = Cancel(request_id=request_id, lease_id=lease_id)
        try:
            await self._nc.publish(cancel_subject(worker_id), encode(cancel))
            await self._nc.flush(timeout=2)
        except Exception as exc:  # NATS down: the agent's own deadline ends the request
            log.warning("cancel_publish_failed", request_id=request_id, worker_id=worker_id, error=str(exc))
        else:
            log.info("request_cancelled", request_id=request_id, worker_id=worker_id, reason=reason)

    async def open(
        self,
        *,
        request_id: str,
        endpoint: Endpoint,
        model: str,
        body: bytes,
        stream: bool,
        token_ids: Sequence[int] | None,
        prompt_tokens: int,
        exclude: list[str] | None = None,
        session_ids: list[str] | None = None,
        traceparent: str | None = None,
        sequences: int = 1,
        samples: int = 1,
        after_silence: bool = False,
        cache_salt: str | None = None,
    ) -> Exchange:
        """Ask the router to place the request (on none of ``exclude``); ``ApiError`` when it is not placed.

        ``session_ids``: every value of the client's session header, in order, unmodified (the
        router validates them). Each attempt gets its own inbox subject and a fresh deadline.
        ``after_silence``: the previous attempt got no route reply (``Placement.place``).
        """
        subject, box = self.inbox.open()
        data = encode(RouteRequest(
            request_id=request_id, model=model, endpoint=endpoint, body=body, stream=stream,
            reply_subject=subject, prompt_tokens=prompt_tokens,
            tokens=None if token_ids is None else pack_tokens(token_ids), cache_salt=cache_salt,
            deadline=time.time() + self.deadline_in(), route_deadline=time.time() + self.route_timeout,
            exclude=list(exclude or ()),
            session_ids=list(session_ids or ()), discovery_backend=self.discovery_backend, traceparent=traceparent,
            sequences=sequences, samples=samples, keepalive=self.keepalive, upstream_timeout=self.upstream_timeout,
        ))
        if len(data) > self._nc.max_payload:
            self.inbox.release(subject)
            raise ApiError(
                413, f"The request is {len(data)} bytes on the bus (body plus token ids for routing); the NATS "
                f"server accepts at most {self._nc.max_payload} bytes per message: raise max_payload in the "
                "nats-server configuration (infera up and compose.yaml set 8 MiB) or send a shorter prompt.",
                type="invalid_request_error", code="request_too_large",
            )
        try:
            reply, early = await self._placement.place(data, subject, box, after_silence)
        except asyncio.CancelledError:  # the client left while the router decides: cancel once placed
            self.spawn(self._cancel_when_routed(subject, box, request_id))
            raise
        except NoRouter:  # nobody received the request: trying again cannot run it twice
            self.inbox.release(subject)
            self._router_unavailable(request_id, "no responders")
            raise RetryableError(503, "router unavailable", type="service_unavailable_error",
                                 reason=NO_ROUTER) from None
        except TimeoutError:  # a router holds it and does not answer: it drops it past route_deadline
            self.inbox.release(subject)
            self._router_unavailable(request_id, f"no route reply within --route-timeout {self.route_timeout:g}s")
            raise RetryableError(503, f"router unavailable: no answer within {self.route_timeout:g}s",
                                 type="service_unavailable_error", reason=ROUTE_TIMEOUT) from None
        except OSError as exc:
            self.inbox.release(subject)
            self._router_unavailable(request_id, repr(exc))
            raise router_unavailable() from None
        except ValueError as exc:
            self.inbox.release(subject)
            self.metrics.route_errors.labels("500").inc()
            log.error("bad_route_reply", request_id=request_id, error=str(exc))
            raise ApiError(500, "the router sent an unreadable reply") from None
        except Exception as exc:  # NATS connection closed or draining
            self.inbox.release(subject)
            self._router_unavailable(request_id, repr(exc))
            raise router_unavailable() from None
        if reply.status != 200 or not reply.worker_id:
            self.inbox.release(subject)
            self.metrics.route_errors.labels(str(reply.status)).inc()
            raise router_error(reply)
        if early:
            box.push_front(early)
        expected = prompt_tokens if token_ids is not None else None  # None: no count to check against
        lease = (reply.lease_id, reply.router_id) if reply.lease_id and reply.router_id else None
        frames_router = reply.router_id if reply.frames_from == "router" else None
        exchange = Exchange(self, request_id, reply.worker_id, subject, box, stream, endpoint, expected, lease,
                            frames_router, sender_known=reply.frames_from is not None)
        self._open.add(exchange)
        return exchange

    def _router_unavailable(self, request_id: str, error: str) -> None:
        """Counted always; logged the first time for each cause, then once every ``ROUTER_ERRORS_LOG_EVERY`` s."""
        self.metrics.route_errors.labels("503").inc()
        held = self._router_errors.let_through(error, time.monotonic())
        if held is not None:
            log.warning("router_unavailable", request_id=request_id, error=error,
                        **({"repeated": held} if held else {}))

    @property
    def open_requests(self) -> int:
        """Placed requests whose answer is not finished."""
        return len(self._open)

    def forget(self, exchange: Exchange) -> None:
        """``exchange`` is closed."""
        self._open.discard(exchange)

    async def resync(self) -> None:
        """After a reconnect: check every open request's frames with its worker (see the module doc)."""
        # absences seen while this frontend was away from the broker mean nothing
        self.watch.reset(asyncio.get_running_loop().time())
        for (router_id, worker_id), exchanges in by_sender(e for e in self._open if not e.ended).items():
            self.spawn(self._resync_worker(router_id, worker_id, exchanges))

    async def _resync_worker(self, router_id: str | None, worker_id: str, exchanges: list[Exchange]) -> None:
        """Ask whoever sends the frames of ``worker_id``'s ``exchanges`` (its agent, or ``router_id``)."""
        subject, query = frames_query(router_id, worker_id, exchanges)
        answer = await self._ask_worker(subject, query, FramesSent, exchanges)
        if answer is None:
            log.info("frames_query_unanswered", worker_id=worker_id, router_id=router_id, requests=len(exchanges))
            return
        sent = answer.sent
        short = [e for e in exchanges if not e.has_all(sent.get(e.request_id))]
        if short:
            await asyncio.sleep(IN_TRANSIT_GRACE)
        short = [e for e in short if not e.has_all(sent.get(e.request_id))]
        for exchange in short:
            if exchange.request_id in sent:
                exchange.fill_gap(again=True)
            else:
                exchange.lose(f"worker {worker_id} never received this request (its queue was lost when the "
                              "message broker restarted)")
                self._release_lost(exchange)
        log.info("frames_resynced", worker_id=worker_id, requests=len(exchanges), short=len(short))

    # --- senders that left the bus (sender_watch.py) ---------------------------------------------
    def start_watch(self) -> None:
        self._watch_task = asyncio.get_running_loop().create_task(self._watch_senders(), name="sender-watch")

    async def stop_watch(self) -> None:
        task, self._watch_task = self._watch_task, None
        await stop_tasks(task)

    async def _watch_senders(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(SENDER_CHECK_EVERY)
            try:
                self.check_silent(loop.time())
            except Exception:  # never the end of the watch
                log.exception("sender_watch_failed")

    def check_silent(self, now: float) -> None:
        """Ask the sender of every request silent for ``SILENT_AFTER`` s whether it is still on the bus."""
        if not self._nc.is_connected:
            self.watch.reset(now)
            return
        open_now = [e for e in self._open if not e.ended and e.sender_known]
        self.watch.forget_except(open_now)
        silent = by_sender(e for e in open_now if self.watch.silent(e, e.heard, now))
        for sender, exchanges in silent.items():
            if sender not in self._asking:
                self._asking.add(sender)
                self.spawn(self._ask_sender(sender, exchanges))

    async def _ask_sender(self, sender: tuple[str | None, str], exchanges: list[Exchange]) -> None:
        router_id, worker_id = sender
        subject, query = frames_query(router_id, worker_id, exchanges)
        try:
            await self._nc.request(subject, encode(query), timeout=SENDER_QUESTION_TIMEOUT)
            on_bus = True
        except nats.errors.NoRespondersError:
            on_bus = False
        except (nats.errors.TimeoutError, TimeoutError):
            on_bus = True  # subscribed, only slow to answer: its requests wait on
        except Exception:  # the connection in trouble: asked again at the next check
            return
        finally:
            self._asking.discard(sender)
        if on_bus:
            self.watch.present(sender)
            return
        now = asyncio.get_running_loop().time()
        absent_s = self.watch.absent(sender, now)
        gone = [e for e in exchanges if not e.ended and self.watch.gone(sender, e.heard, now)]
        if gone:
            self._sender_gone(router_id, worker_id, gone, absent_s)

    def _sender_gone(self, router_id: str | None, worker_id: str, exchanges: list[Exchange], absent_s: float) -> None:
        """Nothing will send these requests' frames any more: end them now (retried on another
        worker while their clients have nothing), not after --discovery-ttl or --upstream-timeout."""
        who = f"router {router_id}, which ran it on the engine," if router_id else "its worker-agent"
        for exchange in exchanges:
            exchange.lose(f"worker {worker_id}: {who} left the message bus before answering", reason=SENDER_GONE)
            self._release_lost(exchange)
        self.metrics.senders_gone.inc()
        log.warning("sender_gone", worker_id=worker_id, router_id=router_id, requests=len(exchanges),
                    absent_s=round(absent_s, 2))

    def _release_lost(self, exchange: Exchange) -> None:
        """The worker never received the request, so no ``Release`` will come from it: give the
        placing router its lease back (else the worker counts as busier until the lease ages out)."""
        if exchange.lease is None:
            return
        lease_id, router_id = exchange.lease
        release = Release(lease_id=lease_id, worker_id=exchange.worker_id, outcome="cancelled")
        self.spawn(self._publish_quietly(router_release_subject(router_id), encode(release), exchange.request_id))

    async def _publish_quietly(self, subject: str, data: bytes, request_id: str) -> None:
        try:
            await self._nc.publish(subject, data)
        except Exception as exc:  # NATS down again: the lease ages out instead
            log.warning("publish_failed", subject=subject, request_id=request_id, error=str(exc) or type(exc).__name__)

    async def ask_replay(self, exchange: Exchange, from_seq: int) -> int | None:
        """Ask the exchange's worker to send its frames from ``from_seq`` on again: how many it sent
        (-1: it no longer has them), or None when it does not answer."""
        ask = FramesReplay(request_id=exchange.request_id, from_seq=from_seq, worker_id=exchange.worker_id)
        subject = frames_subjects(*exchange.sender)[1]
        answer = await self._ask_worker(subject, ask, FramesReplayed, [exchange])
        return None if answer is None else answer.count

    async def _ask_worker(self, subject: str, question: BaseModel, answer_type: type[M],
                          for_exchanges: list[Exchange]) -> M | None:
        """Request/reply with a worker-agent that may not be back on the broker yet: asked again every
        ``RESYNC_RETRY`` s while nobody answers (``RESYNC_ATTEMPTS`` times), and no more once every
        exchange in ``for_exchanges`` has ended; None when it never answers or answers unreadably."""
        data = encode(question)
        for _ in range(RESYNC_ATTEMPTS):
            if all(e.ended for e in for_exchanges):
                return None  # answered meanwhile (or the frontend is stopping)
            try:
                msg = await self._nc.request(subject, data, timeout=FRAMES_QUERY_TIMEOUT)
                return decode(answer_type, msg.data)
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
                await asyncio.sleep(RESYNC_RETRY)  # its agent is not back yet (or this plane has none)
            except Exception as exc:  # an unreadable answer, or the connection closing
                log.warning("worker_question_failed", subject=subject, error=str(exc) or type(exc).__name__)
                return None
        return None

    def deadline_in(self) -> float:
        """Seconds until nobody waits for the answer: a request lives while its worker keeps speaking
        (frames, or ``alive`` frames until the answer begins), up to the request timeout."""
        return max(self.request_timeout, self.route_timeout + self.upstream_timeout)

    @property
    def keepalive(self) -> float:
        """How often a worker is asked to say that the engine still holds a request whose answer has
        not begun (``alive`` frames): three times per ``--upstream-timeout``, so that a late or lost
        one does not end a request the engine is working on."""
        return self.upstream_timeout / KEEPALIVES_PER_TIMEOUT

    async def _cancel_when_routed(self, subject: str, box: Mailbox, request_id: str) -> None:
        try:
            reply, _ = await self._placement.reply(box)
        except Exception:  # never placed (or unreadable): nothing to cancel
            return
        finally:
            self.inbox.release(subject)
        if reply.status == 200 and reply.worker_id:
            self.publish_cancel(reply.worker_id, request_id, "client_disconnect", reply.lease_id or "")
