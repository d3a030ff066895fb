"""The storage probe: free space where model weights and dumps would go, and the throughput of
writing and reading back ``--storage-gb`` GiB there (read back from the device, not the page cache:
the file is synced and its cached pages dropped first). ``pick_mount`` and ``storage_findings``
decide; ``measure`` and ``run_storage`` do the I/O."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from infera.tools.preflight.finding import Finding, skipped
from infera_common.host.sysfs import read_text

GIB = 1 << 30
CHUNK = 64 << 20
#: filesystems that hold no data of their own worth measuring
VIRTUAL_FS = {"squashfs", "iso9660", "tmpfs", "devtmpfs", "overlay", "proc", "sysfs", "cgroup2", "nsfs"}


def pick_mount(mounts: str, free: Callable[[str], int | None]) -> str | None:
    """Of the block-device mounts in ``mounts`` (``/proc/mounts``), the one with the most free bytes."""
    best: tuple[int, str] | None = None
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) < 3 or not parts[0].startswith("/dev/") or parts[2] in VIRTUAL_FS:
            continue
        space = free(parts[1])
        if space is not None and (best is None or space > best[0]):
            best = (space, parts[1])
    return None if best is None else best[1]


def free_bytes(path: str) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def measure(path: str, gib: float) -> tuple[float, float]:
    """MB/s writing ``gib`` GiB to a new file under ``path`` (synced), then reading it back."""
    size = int(gib * GIB)
    block = memoryview(os.urandom(min(CHUNK, size) or 1))
    fd, name = tempfile.mkstemp(prefix=".infera-preflight-", dir=path)
    try:
        t0 = time.perf_counter()
        written = 0
        while written < size:
            written += os.write(fd, block[:size - written])  # a view: no copy of the chunk
        os.fsync(fd)
        write_s = time.perf_counter() - t0
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.lseek(fd, 0, os.SEEK_SET)
        t0 = time.perf_counter()
        while os.read(fd, CHUNK):
            pass
        read_s = time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(name)
    mb = size / 1e6
    return mb / max(write_s, 1e-9), mb / max(read_s, 1e-9)


def storage_findings(path: str, free: int | None, gib: float, rates: tuple[float, float] | None) -> list[Finding]:
    space = f"{free / GIB:.0f} GiB free" if free is not None else "free space unknown"
    found = [Finding("info", f"{path}: {space}", {"path": path, "free_bytes": free})]
    if gib <= 0:
        found.append(skipped("storage throughput", "--storage-gb 0"))
    elif free is not None and free < 2 * gib * GIB:
        found.append(Finding("warn", f"storage throughput: not measured, {path} has less than twice --storage-gb "
                             f"({gib:g} GiB) free"))
    elif rates is not None:
        write, read = rates
        found.append(Finding("info", f"{path}: write {write:,.0f} MB/s, read {read:,.0f} MB/s ({gib:g} GiB)",
                             {"write_mb_s": round(write), "read_mb_s": round(read)}))
    return found


def run_storage(storage_path: str, gib: float, root: Path = Path("/")) -> list[Finding]:
    if storage_path and not Path(storage_path).is_dir():
        return [Finding("fail", f"--storage-path {storage_path} is not a directory")]
    path = storage_path or pick_mount(read_text(root / "proc/mounts") or "", free_bytes) or os.getcwd()
    free = free_bytes(path)
    rates = None
    if gib > 0 and (free is None or free >= 2 * gib * GIB):
        try:
            rates = measure(path, gib)
        except OSError as exc:
            return [*storage_findings(path, free, 0, None)[:1],
                    Finding("warn", f"storage throughput: cannot write under {path} ({exc.strerror or exc}); "
                            "pass --storage-path to a writable directory")]
    return storage_findings(path, free, gib, rates)
