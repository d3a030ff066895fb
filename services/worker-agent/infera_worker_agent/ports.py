"""Finding free TCP ports for the engine's KV-event publishers (one contiguous block per DP rank)."""

from __future__ import annotations

import random
import socket

_LOW, _HIGH = 20000, 60000


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def free_port_block(n: int, attempts: int = 200, taken: set[int] | None = None) -> int:
    """The first of ``n`` contiguous ports that are free now (and not in ``taken``); marks them taken."""
    taken = _TAKEN if taken is None else taken
    for _ in range(attempts):
        base = random.randint(_LOW, _HIGH - n)
        block = range(base, base + n)
        if not any(p in taken for p in block) and all(_free(p) for p in block):
            taken.update(block)
            return base
    raise OSError(f"no block of {n} free ports found")


_TAKEN: set[int] = set()  # ports handed out by this process (two blocks must not overlap)
