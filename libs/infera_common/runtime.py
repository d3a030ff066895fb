"""Process-level helpers every service shares: the event loop and free ports."""

from __future__ import annotations

import asyncio
import socket


def event_loop_runner() -> asyncio.Runner:
    """An ``asyncio.Runner`` on uvloop when it is installed (it cuts per-message latency), else asyncio's."""
    try:
        import uvloop
    except ImportError:  # optional speed-up
        return asyncio.Runner()
    return asyncio.Runner(loop_factory=uvloop.new_event_loop)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
