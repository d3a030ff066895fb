"""The clock offsets of the frontends whose route requests arrive, asked over the bus.

A route request's ``route_deadline`` is on its frontend's wall clock (``clock_offsets`` says why a
router must not read it on its own). The first route request from a frontend, and any that comes
``clock_offsets.RESYNC_AFTER`` seconds after the last question, has the frontend asked the time on
its ``alive`` subject (``subjects.requester_alive_subject``, the subject the worker-agents ask
whether it is still there), in a task: no route request waits for the answer. Until one arrives,
the frontend's deadlines are not checked (a frontend that predates the question answers nothing
but an empty message, and is never checked). A frontend gone from the bus ("no responders") is
forgotten.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Coroutine

import nats.errors

from infera_common.clock_offsets import MAX_PEERS, ClockOffsets, read_time_answer
from infera_common.logs import get_logger
from infera_common.subjects import requester_alive_subject

log = get_logger("router.clocks")

ASK_TIMEOUT = 1.0
#: An offset this large (seconds) is logged once per frontend: the hosts' time sync is off.
WARN_OFFSET = 1.0


class RequesterClocks:
    def __init__(self, nc, spawn: Callable[[Coroutine], None],  # noqa: ANN001 - a NATS client
                 largest: Callable[[float], None] | None = None) -> None:
        self._nc = nc
        self._spawn = spawn
        self._largest = largest  # told the largest offset known, in absolute seconds, at each change (a gauge)
        self._offsets = ClockOffsets()
        self._warned: set[str] = set()

    def offset_for(self, reply_subject: str) -> float | None:
        """Seconds this router's clock is ahead of the clock of the frontend behind ``reply_subject``
        (None: not known yet, or not a frontend's); asks the frontend when an answer is due."""
        key = requester_alive_subject(reply_subject)
        if key is None:
            return None
        now = time.monotonic()
        if self._offsets.due(key, now):
            self._offsets.asked(key, now)
            self._spawn(self.ask(key))
        return self._offsets.offset(key)

    async def ask(self, key: str) -> float | None:
        """Ask the frontend at ``key`` the time; the offset measured (None: no usable answer)."""
        sent = time.time()
        try:
            msg = await self._nc.request(key, b"", timeout=ASK_TIMEOUT)
        except nats.errors.NoRespondersError:  # gone: asked afresh should it come back
            self._offsets.forget(key)
            if self._largest is not None:
                self._largest(self._offsets.largest())
            return None
        except Exception:  # a timeout (busy), or this router's own connection in trouble: ask again later
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
                        hint="this host's clock and the frontend's disagree: route deadlines are read with the "
                             "offset, but other deadlines assume the hosts' time is synchronised (NTP, chrony)")
        return offset

    def __len__(self) -> int:
        return len(self._offsets)
