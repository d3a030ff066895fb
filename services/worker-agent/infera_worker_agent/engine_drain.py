"""Draining on ``--request-transport http``: the routers call the engine directly, so the agent
sees no request; the engine's own running + waiting counts (its /metrics, as in load reports)
tell when the work the routers sent before they saw ``draining`` is done.

``IdleCheck`` is the pure decision: idle once the engine has reported nothing running and
nothing waiting on ``quiet_polls`` polls in a row (a request a router sent just before it saw
``draining`` may still be on its way to the engine at the first idle poll). A poll that could
not read the counts is not idle: an engine whose load is unknown is waited for until the drain
timeout. ``drain_engine`` is the wait itself, also ended by a second signal or the engine's exit.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from infera_common.logs import get_logger
from infera_worker_agent.engine_proc import EngineProcess
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


async def drain_engine(scrape: Callable[[], Awaitable[EngineLoad | None]], timeout: float, force: asyncio.Event,
                       engine: EngineProcess) -> None:
    """The agent stops on the HTTP request plane: the routers stop sending once they see ``draining``;
    wait for the engine's own counts to reach zero (or ``timeout``, or ``force``: a second signal, or
    the engine's exit). What is left is cut off when the engine stops."""
    drained = asyncio.create_task(wait_engine_idle(scrape, timeout))
    forced = asyncio.create_task(force.wait())
    engine_exit = asyncio.create_task(engine.wait())
    await asyncio.wait({drained, forced, engine_exit}, return_when=asyncio.FIRST_COMPLETED)
    for task in (forced, engine_exit):
        task.cancel()
    if not drained.done():
        drained.cancel()
        await asyncio.gather(drained, return_exceptions=True)
        if force.is_set():
            log.warning("drain_skipped_by_second_signal")
        else:
            log.warning("engine_exited_while_draining", exit_code=engine.returncode)
        return
    result = drained.result()
    if result.idle:
        log.info("engine_idle")
    else:
        last = result.last
        log.warning("drain_timeout_engine_busy", drain_timeout_s=timeout,
                    engine_running=last.running if last else None, engine_waiting=last.waiting if last else None)
