"""Stopping background tasks for certain, on Python 3.11 too.

On 3.11 ``asyncio.wait_for`` returns the inner result instead of raising when its task is
cancelled just after the inner future finished (fixed in 3.12, where it is built on
``asyncio.timeout``). nats-py's requests, flushes and JetStream calls all go through ``wait_for``:
a loop task cancelled in that moment (a heartbeat whose put the broker had just acknowledged)
runs on as if never cancelled, and ``task.cancel(); await asyncio.gather(task)`` then waits for it
forever. ``stop_tasks`` cancels again until the task has really stopped.

For loop tasks only (heartbeats, watchers, probes, sweepers), whose cancellation has nothing to
clean up: a task still running after ``RECANCEL_EVERY`` is cancelled again, which would cut short
a cleanup of its own.
"""

from __future__ import annotations

import asyncio

from infera_common.logs import get_logger

log = get_logger("tasks")

#: Seconds a cancelled task is given to stop before it is taken to have lost the cancellation.
RECANCEL_EVERY = 0.1
#: Seconds after which a task that still runs is logged and left running.
GIVE_UP_AFTER = 10.0


async def stop_tasks(*tasks: asyncio.Task | None, give_up_after: float = GIVE_UP_AFTER) -> None:
    """Cancel ``tasks`` (None entries are skipped) and return once every one has stopped, cancelling
    again each one that is still running every ``RECANCEL_EVERY`` seconds; after ``give_up_after``
    seconds, log the ones that still run (``task_ignores_cancellation``) and return. A task's own
    exception is taken (not raised, nor reported later as never retrieved)."""
    running = {t for t in tasks if t is not None and not t.done()}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + give_up_after
    while running:
        for task in running:
            task.cancel()
        _, running = await asyncio.wait(running, timeout=RECANCEL_EVERY)
        if running and loop.time() >= deadline:
            log.error("task_ignores_cancellation", tasks=sorted(t.get_name() for t in running))
            break
    for task in tasks:
        if task is not None and task.done() and not task.cancelled():
            task.exception()
