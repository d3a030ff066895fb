"""Waiting for a condition in a test: the one helper every test module uses.

An integration bound, not a timing assertion: the timeout only says when to give up.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any


async def eventually(check: Callable[[], Any | Awaitable[Any]], timeout: float = 10.0, every: float = 0.02,
                     what: str = "condition") -> Any:
    """Poll ``check()`` (sync or async) until it returns something truthy, and return that; after
    ``timeout`` seconds fail the test with ``what`` and the last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {timeout}s; last value {value!r}")
        await asyncio.sleep(every)
