"""An in-process message bus with the core-NATS semantics of the nats-py ``Client`` subset Infera uses.

``python -m infera.server`` runs the frontend, router and kv-indexer in one process on the no-broker
plane (etcd discovery, HTTP to the engines, ZMQ KV events). Their internal traffic (route
request/reply, inbox replies, kv-indexer queries, load reports) keeps its NATS shape: each service
gets its own ``LocalClient`` from one ``LocalBus``, as each would hold its own connection to one
nats-server. What a service sees is what nats-py gives it:

- ``publish(subject, payload, reply, headers)``, ``subscribe(subject, queue, cb)`` returning a
  subscription with ``unsubscribe()``/``drain()``, ``request()`` (``nats.errors.NoRespondersError``,
  ``nats.errors.TimeoutError``), ``new_inbox()``, ``flush()``, ``max_payload``, ``drain()``,
  ``close()``, ``is_connected``/``is_closed``/``is_draining``; messages are nats-py ``Msg`` objects
  (``respond()`` publishes to ``reply`` through the receiving client, as nats-py does).
- Wildcards ``*``/``>`` (``subject_match.py``); a queue group delivers each message to one random
  member, plain subscribers all get it; a publish with a reply subject that nobody is subscribed to
  gets a "no responders" message (no data, header ``Status: 503``) on that reply subject, sent to
  the publishing client only, as a nats-server 2.x does.
- One task per callback subscription: its messages in publish order, its callbacks one at a time,
  different subscriptions concurrently. ``publish`` never waits for a subscriber: a subscription's
  pending queue is bounded (nats-py's limits, 512Ki messages / 128 MiB) and what overflows is dropped,
  counted and logged as a slow consumer. A callback that raises is logged; the subscription goes on.
- Payloads are passed by reference (bytes are immutable); headers are copied per delivery.
- No JetStream: ``jetstream()`` raises ``JetStreamUnavailableError``.

Usage: ``bus = LocalBus(max_payload=64 << 20)``, then ``nc = bus.connect("router")`` per service in
place of ``nats_conn.connect(...)``; ``await bus.close()`` at exit. ``bus.metrics.registry`` holds
the ``infera_bus_*`` metrics. Subscriptions and their delivery tasks are in ``local_bus_sub.py``.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import random
import secrets
from urllib.parse import ParseResult, urlparse

from nats import errors
from nats.aio.msg import Msg
from nats.aio.subscription import DEFAULT_SUB_PENDING_BYTES_LIMIT, DEFAULT_SUB_PENDING_MSGS_LIMIT
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from infera_common.local_bus_sub import Callback, LocalSubscription
from infera_common.logs import get_logger
from infera_common.subject_match import SubjectIndex, subject_error
from infera_common.subjects import INBOX_PREFIX

log = get_logger("bus")

#: A nats-server's default ``max_payload``; ``LocalBus(max_payload=...)`` raises it.
DEFAULT_MAX_PAYLOAD = 1 << 20
#: The header nats-py reads a status from, and the status of "no responders".
STATUS_HEADER = "Status"
NO_RESPONDERS_STATUS = "503"
#: Seconds ``drain()`` lets subscriptions finish what they hold (nats-py's default ``drain_timeout``).
DEFAULT_DRAIN_TIMEOUT = 30.0
#: Seconds ``close()`` waits for cancelled callback tasks to stop.
CLOSE_WAIT = 5.0

_CONNECTED, _DRAINING_SUBS, _DRAINING_PUBS, _CLOSED = range(4)


class JetStreamUnavailableError(errors.Error):
    """JetStream was asked of the in-process bus, which has none."""

    def __str__(self) -> str:
        return ("the in-process bus (python -m infera.server) has no JetStream: it carries core NATS only; "
                "run with --discovery-backend etcd --request-transport http --kv-event-transport zmq, "
                "or give every service --nats-url of a nats-server started with -js")


class BusMetrics(Collector):
    """What an operator watches on the bus: traffic, no-responders, slow consumers, failing callbacks.

    The per-message count is a plain integer read at scrape time (``published``): publish stays cheap.
    """

    def __init__(self, bus: LocalBus, registry: CollectorRegistry | None = None) -> None:
        self._bus = bus
        self.published = 0
        self.registry = r = registry or CollectorRegistry()
        self.no_responders = Counter(
            "infera_bus_no_responders", "Publishes with a reply subject that no subscriber received.", registry=r)
        self.dropped = Counter(
            "infera_bus_dropped_messages", "Messages dropped because a subscription's pending queue was full "
            "(slow consumer), by client and subscription subject.", ["client", "subject"], registry=r)
        self.callback_errors = Counter(
            "infera_bus_callback_errors", "Subscription callbacks that raised, by client and subscription subject.",
            ["client", "subject"], registry=r)
        r.register(self)

    def collect(self):
        yield CounterMetricFamily("infera_bus_messages", "Messages published on the in-process bus.",
                                  value=self.published)
        yield GaugeMetricFamily("infera_bus_pending_messages", "Messages waiting in subscriptions' queues.",
                                value=self._bus.pending_messages())
        yield GaugeMetricFamily("infera_bus_subscriptions", "Subscriptions on the bus.",
                                value=self._bus.subscription_count())


class LocalBus:
    """The 'server': one subject index shared by every client of the process."""

    def __init__(self, *, max_payload: int = DEFAULT_MAX_PAYLOAD, name: str = "infera",
                 registry: CollectorRegistry | None = None, drain_timeout: float = DEFAULT_DRAIN_TIMEOUT) -> None:
        if max_payload <= 0:
            raise ValueError(f"max_payload must be positive, got {max_payload}")
        self.max_payload = max_payload
        self.name = name
        self.drain_timeout = drain_timeout
        self._index: SubjectIndex[LocalSubscription] = SubjectIndex()
        self._clients: list[LocalClient] = []
        self._ids = itertools.count(1)
        self.metrics = BusMetrics(self, registry)

    def connect(self, name: str = "") -> LocalClient:
        """A new client ('connection') on this bus; ``name`` shows in logs and metrics."""
        client = LocalClient(self, name or f"client-{next(self._ids)}")
        self._clients.append(client)
        return client

    @property
    def clients(self) -> list[LocalClient]:
        return list(self._clients)

    async def close(self) -> None:
        """Close every client (their subscriptions stop; later publishes raise ``ConnectionClosedError``)."""
        for client in list(self._clients):
            await client.close()

    def pending_messages(self) -> int:
        return sum(sub.pending_msgs for client in self._clients for sub in client._subs.values())

    def subscription_count(self) -> int:
        return len(self._index)

    # --- routing ---------------------------------------------------------------------------
    def _route(self, sender: LocalClient, subject: str, reply: str, data: bytes, headers: dict | None) -> None:
        self.metrics.published += 1
        subs = self._index.match(subject)
        if not subs:
            if reply:
                self._no_responders(sender, reply)
            return
        if len(subs) == 1:
            subs[0]._deliver(subject, reply, data, headers)
            return
        groups: dict[str, list[LocalSubscription]] | None = None
        for sub in subs:
            if not sub.queue:
                sub._deliver(subject, reply, data, headers)
            else:
                if groups is None:
                    groups = {}
                groups.setdefault(sub.queue, []).append(sub)
        if groups:
            for members in groups.values():
                random.choice(members)._deliver(subject, reply, data, headers)

    def _no_responders(self, sender: LocalClient, reply: str) -> None:
        """What a nats-server sends a requester when nobody is subscribed: to the publisher only."""
        self.metrics.no_responders.inc()
        for sub in self._index.match(reply):
            if sub._client is sender:
                sub._deliver(reply, "", b"", {STATUS_HEADER: NO_RESPONDERS_STATUS})

    def _add(self, sub: LocalSubscription) -> None:
        self._index.add(sub.subject, sub)

    def _remove(self, sub: LocalSubscription) -> None:
        self._index.remove(sub.subject, sub)

    def _forget(self, client: LocalClient) -> None:
        if client in self._clients:
            self._clients.remove(client)


class LocalClient:
    """The nats-py ``Client`` subset Infera's services use, on a ``LocalBus`` (see the module doc)."""

    def __init__(self, bus: LocalBus, name: str) -> None:
        self._bus = bus
        self.name = name
        self._status = _CONNECTED
        self._subs: dict[int, LocalSubscription] = {}
        self._sids = itertools.count(1)
        self._inbox_base = f"{INBOX_PREFIX}.{secrets.token_hex(8)}"
        self._inbox_ids = itertools.count(1)
        self._resp_sub: LocalSubscription | None = None
        self._resp_prefix = ""
        self._resp_map: dict[str, asyncio.Future] = {}
        self._req_ids = itertools.count(1)

    # --- state -----------------------------------------------------------------------------
    @property
    def max_payload(self) -> int:
        return self._bus.max_payload

    @property
    def is_connected(self) -> bool:
        return self._status != _CLOSED

    @property
    def is_closed(self) -> bool:
        return self._status == _CLOSED

    @property
    def is_draining(self) -> bool:
        return self._status in (_DRAINING_SUBS, _DRAINING_PUBS)

    @property
    def is_draining_pubs(self) -> bool:
        return self._status == _DRAINING_PUBS

    @property
    def is_reconnecting(self) -> bool:
        return False

    @property
    def is_connecting(self) -> bool:
        return False

    @property
    def connected_url(self) -> ParseResult | None:
        return urlparse(f"inproc://{self._bus.name}/{self.name}") if self.is_connected else None

    def jetstream(self, **_opts) -> None:
        raise JetStreamUnavailableError

    def new_inbox(self) -> str:
        """A subject no other inbox of the bus uses: ``_INBOX.<client token><n>``."""
        return f"{self._inbox_base}{next(self._inbox_ids)}"

    # --- publish / subscribe ---------------------------------------------------------------
    async def publish(self, subject: str, payload: bytes = b"", reply: str = "",
                      headers: dict[str, str] | None = None) -> None:
        if subject_error(subject, pattern=False) or (reply and subject_error(reply, pattern=False)):
            raise errors.BadSubjectError
        if self._status == _CLOSED:
            raise errors.ConnectionClosedError
        if self._status == _DRAINING_PUBS:
            raise errors.ConnectionDrainingError
        if type(payload) is not bytes:  # a bytearray/memoryview the publisher may reuse: receivers get bytes
            payload = bytes(payload)
        if len(payload) > self._bus.max_payload:
            raise errors.MaxPayloadError
        self._bus._route(self, subject, reply, payload, headers)

    async def subscribe(self, subject: str, queue: str = "", cb: Callback | None = None, future=None,
                        max_msgs: int = 0, pending_msgs_limit: int = DEFAULT_SUB_PENDING_MSGS_LIMIT,
                        pending_bytes_limit: int = DEFAULT_SUB_PENDING_BYTES_LIMIT) -> LocalSubscription:
        if future is not None:
            raise errors.Error("the in-process bus does not take subscribe(future=...): pass cb")
        if subject_error(subject, pattern=True) or (queue and any(c.isspace() for c in queue)):
            raise errors.BadSubjectError
        if self._status == _CLOSED:
            raise errors.ConnectionClosedError
        if self.is_draining:
            raise errors.ConnectionDrainingError
        if cb is not None and not (inspect.iscoroutinefunction(cb) or inspect.iscoroutinefunction(
                getattr(cb, "func", None)) or inspect.iscoroutinefunction(getattr(cb, "__call__", None))):
            raise errors.Error("nats: must use coroutine for subscriptions")
        return self._add_sub(subject, queue, cb, max_msgs=max_msgs, pending_msgs_limit=pending_msgs_limit,
                             pending_bytes_limit=pending_bytes_limit)

    def _add_sub(self, subject: str, queue: str, cb: Callback | None, **opts) -> LocalSubscription:
        sub = LocalSubscription(self, next(self._sids), subject, queue, cb, **opts)
        sub._start()
        self._subs[sub._sid] = sub
        self._bus._add(sub)
        return sub

    # --- request / reply -------------------------------------------------------------------
    async def request(self, subject: str, payload: bytes = b"", timeout: float = 0.5, old_style: bool = False,
                      headers: dict[str, str] | None = None) -> Msg:
        """Publish with a reply inbox and wait for the first answer (one wildcard reply subscription per client).

        Raises ``nats.errors.NoRespondersError`` when nobody is subscribed to ``subject`` and
        ``nats.errors.TimeoutError`` (an ``asyncio.TimeoutError``) when no answer comes in ``timeout``.
        """
        if self._status == _DRAINING_PUBS:
            raise errors.ConnectionDrainingError
        if self._status == _CLOSED:
            raise errors.ConnectionClosedError
        if self._resp_sub is None:
            self._resp_prefix = self.new_inbox() + "."
            self._resp_sub = self._add_sub(self._resp_prefix + "*", "", None, direct=self._on_response)
        token = str(next(self._req_ids))
        future: asyncio.Future[Msg] = asyncio.get_running_loop().create_future()
        self._resp_map[token] = future
        try:
            await self.publish(subject, payload, reply=self._resp_prefix + token, headers=headers)
            try:
                msg = await asyncio.wait_for(future, timeout)
            except asyncio.TimeoutError:
                raise errors.TimeoutError from None
        finally:
            self._resp_map.pop(token, None)
        if msg.headers and msg.headers.get(STATUS_HEADER) == NO_RESPONDERS_STATUS:
            raise errors.NoRespondersError
        return msg

    def _on_response(self, msg: Msg) -> None:
        future = self._resp_map.get(msg.subject[len(self._resp_prefix):])
        if future is not None and not future.done():
            future.set_result(msg)

    async def flush(self, timeout: float = 10) -> None:
        """Nothing to wait for: a publish has reached every subscriber's queue when it returns."""
        if timeout <= 0:
            raise errors.BadTimeoutError
        if self._status == _CLOSED:
            raise errors.ConnectionClosedError

    # --- ending ----------------------------------------------------------------------------
    async def drain(self) -> None:
        """Stop every subscription's interest, let each handle what it holds (up to the bus's
        ``drain_timeout``), then close. Publishing is allowed until the subscriptions are drained."""
        if self.is_draining:
            return
        if self._status == _CLOSED:
            raise errors.ConnectionClosedError
        self._status = _DRAINING_SUBS
        try:
            subs = list(self._subs.values())
            if subs:
                await asyncio.wait_for(asyncio.gather(*(sub._drain() for sub in subs)), self._bus.drain_timeout)
        except asyncio.TimeoutError:
            log.warning("bus_drain_timed_out", client=self.name, timeout=self._bus.drain_timeout,
                        pending=sum(sub.pending_msgs for sub in self._subs.values()))
        finally:  # also when the caller gives up on the drain (close_connection's bound)
            if self._status != _CLOSED:
                self._status = _DRAINING_PUBS
                await self.close()

    async def close(self) -> None:
        """Stop every subscription now (pending messages are dropped); later calls raise ``ConnectionClosedError``."""
        if self._status == _CLOSED:
            return
        self._status = _CLOSED
        subs = list(self._subs.values())
        self._subs.clear()
        tasks = []
        for sub in subs:
            self._bus._remove(sub)
            task = sub._kill()
            if task is not None:
                tasks.append(task)
        for future in self._resp_map.values():  # requests in flight end now rather than at their timeout
            if not future.done():
                future.set_exception(errors.ConnectionClosedError())
        self._resp_map.clear()
        self._bus._forget(self)
        if tasks:
            _, stuck = await asyncio.wait(tasks, timeout=CLOSE_WAIT)
            if stuck:
                log.warning("bus_callbacks_ignore_cancel", client=self.name,
                            subjects=sorted({t.get_name() for t in stuck}))
