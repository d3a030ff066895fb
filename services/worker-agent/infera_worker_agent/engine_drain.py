"""Draining on ``--request-transport http``: the routers call the engine directly, so the agent
sees no request; the engine's own running + waiting counts (its /metrics, as in load reports)
tell when the work the routers sent before they saw ``draining`` is done.

``IdleCheck`` is the pure decision: idle once the engine has reported nothing running and
nothing waiting on ``quiet_polls`` polls in a row (a request a router sent just before it saw
``draining`` may still be on its way to the engine at the first idle poll). A poll that could
not read the counts is not idle: an engine whose load is unknown is waited for until the drain
timeout.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from infera_common.logs import get_logger
from infera_worker_agent.load import EngineLoad

log = get_logger("worker_agent.drain")

POLL_INTERVAL = 0.25
QUIET_POLLS = 2


@dataclass
class IdleCheck:
    quiet_polls: int = QUIET_POLLS
    streak: int = 0

    def observe(self, load: EngineLoad | None) -> bool:
        """Feed one poll (None: the counts could not be read); True once the engine counts as idle."""
        if load is not None and load.running == 0 and load.waiting == 0:
            self.streak += 1
        else:
            self.streak = 0
        return self.streak >= self.quiet_polls


@dataclass(frozen=True, slots=True)
class DrainResult:
    idle: bool  # the engine went idle within the timeout
    last: EngineLoad | None  # the last counts read (None: never read)


async def wait_engine_idle(
    scrape: Callable[[], Awaitable[EngineLoad | None]],
    timeout: float,
    *,
    interval: float = POLL_INTERVAL,
    check: IdleCheck | None = None,
) -> DrainResult:
    """Poll ``scrape`` every ``interval`` until the engine counts as idle or ``timeout`` passes."""
    check = check or IdleCheck()
    deadline = time.monotonic() + timeout
    last: EngineLoad | None = None
    warned = False
    while True:
        try:
            load = await scrape()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            load = None
            if not warned:
                warned = True
                log.warning("drain_engine_load_unreadable", error=str(exc) or type(exc).__name__,
                            hint="waiting until --drain-timeout")
        else:
            if load is None and not warned:
                warned = True
                log.warning("drain_engine_load_unknown", hint="the engine's /metrics has no running/waiting counts; "
                            "waiting until --drain-timeout")
        last = load if load is not None else last
        if check.observe(load):
            return DrainResult(True, last)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return DrainResult(False, last)
        await asyncio.sleep(min(interval, remaining))
