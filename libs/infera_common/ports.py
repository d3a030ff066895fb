"""Free TCP ports to listen on, picked below the kernel's ephemeral range.

A port found by binding port 0 lies in the ephemeral range, which every process on the host also
draws the local ports of its outgoing connections from: between the pick and the server's own bind,
a connection may take it (EADDRINUSE). That happened to a mock engine in a trace replay (the
worker-agent picks its engine's port, the engine binds it half a second later). Below the range, only
another listener can take a port, and a pick is checked for being free.

Another listener may be another Infera process that picked the same port and has not bound it yet:
two worker-agents starting together on one host, each picking its engine's port, did pick the same
one (CI, a PD fleet), and SGLang binds its HTTP port only after loading the model, so on a GPU node
the clash would show after the cold start. So every pick is also claimed for the host (``claim``:
a file per port under ``CLAIMS_DIR``, created exclusively, holding the claimant's pid), and no
Infera process picks a port claimed by a process still running, less than ``CLAIM_TTL`` seconds
ago. A claim whose process has ended is taken over at once: with the TTL alone, a machine that ran
the test suite a few times within it (each run claims ~1,100 ports) had most of its 22,768 usable
ports claimed, and no block of 8 contiguous ones was left (a PD fleet failed to start).
"""

from __future__ import annotations

import errno
import os
import random
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
LINUX_EPHEMERAL = (32768, 60999)  # the kernel's default, when the file cannot be read
LOWEST = 10000  # below: ports that well-known services tend to use
_random = random.SystemRandom()  # not the global generator: processes seeded alike must not pick alike
#: One empty file per port picked on this host by any Infera process (every user: sticky, world-writable).
CLAIMS_DIR = Path(tempfile.gettempdir()) / "infera-ports"
#: How long a picked port stays claimed: longer than an engine's cold start before it binds.
CLAIM_TTL = 2 * 3600.0


def claim(port: int, claims_dir: Path = CLAIMS_DIR, now: float | None = None) -> bool:
    """Claim ``port`` for this host; False when a process still running claimed it less than
    ``CLAIM_TTL`` ago. Where no claim can be written (say, a read-only temporary directory) every
    port counts as unclaimed."""
    path = claims_dir / str(port)
    try:
        if not claims_dir.is_dir():
            claims_dir.mkdir(parents=True, exist_ok=True)
            os.chmod(claims_dir, 0o1777)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
        except FileExistsError:
            if _held(path, time.time() if now is None else now):
                return False
            fd = os.open(path, os.O_WRONLY | os.O_TRUNC)  # a lapsed claim: the port is this pick's now
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        return True
    except OSError:
        return True


def _held(path: Path, now: float) -> bool:
    """Whether the claim in ``path`` still holds: younger than ``CLAIM_TTL`` and its process alive
    (a claim without a pid, being written or from an older Infera, holds for the TTL)."""
    if now - path.stat().st_mtime >= CLAIM_TTL:
        return False
    try:
        pid = int(path.read_text() or 0)
    except ValueError:
        return True
    return pid <= 0 or _alive(pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


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
              is_free: Callable[[str, int], bool] = bindable, claim_port: Callable[[int], bool] = claim) -> int:
    """A TCP port free on ``host`` right now and not picked by another Infera process lately
    (``claim``), outside the ephemeral range when one can be found."""
    ports = listen_ports()
    for _ in range(attempts):
        port = _random.choice(ports)
        if is_free(host, port) and claim_port(port):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # everything below was taken: any port
        s.bind((host, 0))
        return s.getsockname()[1]


#: Blocks already handed out by this process (``free_port_block``'s default ``taken``): two must not overlap.
_TAKEN: set[int] = set()


def free_port_block(n: int, taken: set[int] | None = None, host: str = "0.0.0.0", attempts: int = 200,
                    claim_port: Callable[[int], bool] = claim) -> int:
    """The first of ``n`` contiguous ports free now, not in ``taken`` (default: every block this
    process was given) and claimed for this host (``claim``); adds them to ``taken``."""
    taken = _TAKEN if taken is None else taken
    ports = listen_ports()
    for _ in range(attempts):
        base = _random.randrange(ports.start, ports.stop - n)
        block = range(base, base + n)
        if (not any(p in taken for p in block) and all(bindable(host, p) for p in block)
                and all(claim_port(p) for p in block)):
            taken.update(block)
            return base
    raise OSError(f"no block of {n} free ports found")


IN_USE = "in use"
NOT_HERE = "not an address of this host"


def bind_failure(host: str, port: int) -> str | None:
    """Why a server could not listen on ``host:port`` (``IN_USE``, ``NOT_HERE``, or the host not
    resolving), None when it could (or the test bind failed for another reason: the server says).
    A test bind with ``SO_REUSEADDR``, as servers bind, so a port left in TIME_WAIT counts as free."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        return f"{NOT_HERE}: it does not resolve ({exc.strerror})"
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            return {errno.EADDRINUSE: IN_USE, errno.EADDRNOTAVAIL: NOT_HERE}.get(exc.errno or 0)
    return None
