"""The clock offsets of the frontends whose requests arrive, asked over the bus.

A route request's ``route_deadline`` and a work envelope's ``deadline`` are on their frontend's
wall clock (``clock_offsets`` says why another host must not read them on its own). The first
request from a frontend, and any that comes ``clock_offsets.RESYNC_AFTER`` seconds after the last
question, has the frontend asked the time on its ``alive`` subject
(``subjects.requester_alive_subject``, the subject the worker-agents ask whether it is still
there), in a task. ``offset_for`` does not wait for it (a router's route deadlines are not checked
until an answer arrives); ``waiting`` gives the first question, which the first envelopes of a
frontend wait for (a worker-agent, or a router calling engines: an envelope's deadline is read once,
when it arrives). A frontend that
predates the question answers nothing but an empty message, and its deadlines are read as they
are. A frontend gone from the bus ("no responders") is forgotten.

Shared by the router and the worker-agent.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine

import nats.errors

from infera_common.clock_offsets import MAX_PEERS, ClockOffsets, read_time_answer
from infera_common.logs import get_logger
from infera_common.subjects import requester_alive_subject

log = get_logger("requester_clocks")

ASK_TIMEOUT = 1.0
#: How long an envelope waits for its frontend's first answer (``waiting``; ~1 ms on a working
#: bus). Past it the deadline is read as it is (the answer still counts for the envelopes after it).
FIRST_ASK_TIMEOUT = 0.25
#: An offset this large (seconds) is logged once per frontend: the hosts' time sync is off.
WARN_OFFSET = 1.0


class RequesterClocks:
    def __init__(self, nc, spawn: Callable[[Coroutine], None],  # noqa: ANN001 - a NATS client
                 largest: Callable[[float], None] | None = None) -> None:
        self._nc = nc
        self._spawn = spawn
        self._largest = largest  # told the largest offset known, in absolute seconds, at each change (a gauge)
        self._offsets = ClockOffsets()
        self._answers: dict[str, asyncio.Future[float | None]] = {}  # questions under way: their offsets
        self._settled: set[str] = set()  # frontends asked once already (``waiting``)
        self._warned: set[str] = set()

    def offset_for(self, reply_subject: str) -> float | None:
        """Seconds this host's clock is ahead of the clock of the frontend behind ``reply_subject``
        (None: not known yet, or not a frontend's); asks the frontend, in a task, when an answer is due."""
        key = requester_alive_subject(reply_subject)
        if key is None:
            return None
        now = time.monotonic()
        if self._offsets.due(key, now):
            self._offsets.asked(key, now)
            self._answers[key] = asyncio.get_running_loop().create_future()  # (for ``waiting``)
            self._spawn(self.ask(key))
        return self._offsets.offset(key)

    def waiting(self, reply_subject: str) -> asyncio.Future[float | None] | None:
        """The first question to the frontend behind ``reply_subject``, while it is under way (its
        result: the offset, or None); None once any question to it has ended. An envelope's deadline
        is read once, when it arrives: the first ones of a frontend wait for this (each in its own
        task, ``RequestRunner``), or a host whose clock runs ahead would refuse them as expired; a
        frontend that never answers makes requests wait only once."""
        key = requester_alive_subject(reply_subject)
        if key is None or key in self._settled:
            return None
        return self._answers.get(key)

    async def ask(self, key: str) -> float | None:
        """Ask the frontend at ``key`` the time; the offset measured (None: no usable answer)."""
        offset = None
        try:
            offset = await self._ask(key)
            return offset
        finally:
            if len(self._settled) >= MAX_PEERS:  # (each start of a frontend is a new key)
                self._settled.clear()
            self._settled.add(key)
            answer = self._answers.pop(key, None)
            if answer is not None and not answer.done():
                answer.set_result(offset)

    async def _ask(self, key: str) -> float | None:
        sent = time.time()
        try:
            msg = await self._nc.request(key, b"", timeout=ASK_TIMEOUT)
        except nats.errors.NoRespondersError:  # gone: asked afresh should it come back
            self._offsets.forget(key)
            if self._largest is not None:
                self._largest(self._offsets.largest())
            return None
        except Exception:  # a timeout (busy), or this process's own connection in trouble: ask again later
            return None
        received = time.time()
        their_time = read_time_answer(msg.data)
        if their_time is None:  # a frontend from before the question
            return None
        offset = self._offsets.observe(key, sent, their_time, received)
        if offset is None:
            return None
        if self._largest is not None:
            self._largest(self._offsets.largest())
        if abs(offset) >= WARN_OFFSET and key not in self._warned:
            if len(self._warned) >= MAX_PEERS:  # (each start of a frontend is a new key)
                self._warned.clear()
            self._warned.add(key)
            log.warning("requester_clock_offset", frontend=key.split(".")[1], offset_s=round(offset, 3),
                        hint="this host's clock and the frontend's disagree: its deadlines are read with the "
                             "offset, but the kv-indexer's lag and the logs' timestamps assume the hosts' time is "
                             "synchronised (NTP, chrony)")
        return offset

    def __len__(self) -> int:
        return len(self._offsets)
