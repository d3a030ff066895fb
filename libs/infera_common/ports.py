"""Free TCP ports to listen on, picked below the kernel's ephemeral range.

A port found by binding port 0 lies in the ephemeral range, which every process on the host also
draws the local ports of its outgoing connections from: between the pick and the server's own bind,
a connection may take it (EADDRINUSE). That happened to a mock engine in a trace replay (the
worker-agent picks its engine's port, the engine binds it half a second later). Below the range, only
another listener can take a port, and a pick is checked for being free.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Callable

EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
LINUX_EPHEMERAL = (32768, 60999)  # the kernel's default, when the file cannot be read
LOWEST = 10000  # below: ports that well-known services tend to use
_random = random.SystemRandom()  # not the global generator: processes seeded alike must not pick alike


def ephemeral_range(path: str = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The kernel's range of local ports for outgoing connections (first, last)."""
    try:
        with open(path) as f:
            first, last = (int(v) for v in f.read().split())
        return first, last
    except (OSError, ValueError):
        return LINUX_EPHEMERAL


def listen_ports(ephemeral: tuple[int, int] | None = None) -> range:
    """Where to pick listening ports: below the ephemeral range, else above it, else anywhere unprivileged."""
    first, last = ephemeral or ephemeral_range()
    if first - LOWEST >= 1000:
        return range(LOWEST, first)
    if 65535 - last >= 1000:
        return range(last + 1, 65536)
    return range(1024, 65536)


def bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1", attempts: int = 100,
              is_free: Callable[[str, int], bool] = bindable) -> int:
    """A TCP port free on ``host`` right now, outside the ephemeral range when one can be found."""
    ports = listen_ports()
    for _ in range(attempts):
        port = _random.choice(ports)
        if is_free(host, port):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # everything below was taken: any port
        s.bind((host, 0))
        return s.getsockname()[1]


#: Blocks already handed out by this process (``free_port_block``'s default ``taken``): two must not overlap.
_TAKEN: set[int] = set()


def free_port_block(n: int, taken: set[int] | None = None, host: str = "0.0.0.0", attempts: int = 200) -> int:
    """The first of ``n`` contiguous ports free now and not in ``taken`` (default: every block this
    process was given); adds them to ``taken``."""
    taken = _TAKEN if taken is None else taken
    ports = listen_ports()
    for _ in range(attempts):
        base = _random.randrange(ports.start, ports.stop - n)
        block = range(base, base + n)
        if not any(p in taken for p in block) and all(bindable(host, p) for p in block):
            taken.update(block)
            return base
    raise OSError(f"no block of {n} free ports found")
