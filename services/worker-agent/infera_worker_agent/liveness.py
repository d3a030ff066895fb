"""Whether a serving engine counts as healthy, from its health probes in order. Pure, no I/O.

An engine that stops answering while its process lives on (a wedged scheduler, a hung collective)
is the failure the exit watch cannot see. ``failures`` probes in a row that fail make it
unhealthy; one that passes makes it healthy again (the probe exercises the engine's real path:
SGLang's /health runs a one-token generation unless the engine is busy producing output anyway).
"""

from __future__ import annotations


class Liveness:
    __slots__ = ("failures", "healthy", "failed_in_a_row")

    def __init__(self, failures: int) -> None:
        if failures < 1:
            raise ValueError("failures must be at least 1")
        self.failures = failures
        self.healthy = True
        self.failed_in_a_row = 0

    def observe(self, ok: bool) -> bool | None:
        """One probe's outcome; returns the new verdict when it changes (False: unhealthy), else None."""
        if ok:
            self.failed_in_a_row = 0
            if not self.healthy:
                self.healthy = True
                return True
            return None
        self.failed_in_a_row += 1
        if self.healthy and self.failed_in_a_row >= self.failures:
            self.healthy = False
            return False
        return None
