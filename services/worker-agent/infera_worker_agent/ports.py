"""Finding free TCP ports for the engine's KV-event publishers (one contiguous block per DP rank)."""

from __future__ import annotations

from infera_common.ports import free_port_block as _free_block

_TAKEN: set[int] = set()  # ports handed out by this process (two blocks must not overlap)


def free_port_block(n: int, attempts: int = 200, taken: set[int] | None = None) -> int:
    """The first of ``n`` contiguous ports that are free now (and not in ``taken``); marks them taken."""
    return _free_block(n, _TAKEN if taken is None else taken, attempts=attempts)
