"""The engine's watchdog: ``python -m infera_worker_agent.watchdog PGID GRACE``.

A tiny process of its own (its own session, so signals aimed at the agent's group miss it) whose
stdin is a pipe held by the agent. When the pipe reaches end-of-file without the word ``release``
- the agent died, even by SIGKILL - it stops the engine's whole process group: SIGTERM, then
SIGKILL after GRACE seconds. PR_SET_PDEATHSIG alone only reaches the engine's main process; this
reaches the engine's own children too.
"""

from __future__ import annotations

import os
import signal
import sys
import time

RELEASE = b"release"


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def kill_group(pgid: int, grace: float) -> None:
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        time.sleep(0.05)
        if not group_alive(pgid):
            return
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def wait_for_agent(fd: int) -> bool:
    """Block until the agent's pipe closes; True when the agent released the engine first."""
    seen = b""
    while True:
        try:
            chunk = os.read(fd, 64)
        except InterruptedError:
            continue
        if not chunk:
            return False
        seen = (seen + chunk)[-64:]
        if RELEASE in seen:
            return True


def main(argv: list[str]) -> int:
    pgid, grace = int(argv[1]), float(argv[2])
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    if not wait_for_agent(0):
        kill_group(pgid, grace)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
