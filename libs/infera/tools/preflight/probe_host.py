"""The host probe: CPUs, memory, NUMA nodes and the locked-memory limit. ``read_host`` reads,
``host_findings`` decides."""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from pathlib import Path

from infera.tools.preflight.finding import Finding
from infera_common.host.sysfs import read_text, sorted_dirs

GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class HostInfo:
    cpus: int
    mem_bytes: int | None
    numa_nodes: int
    memlock: int | None  # the soft RLIMIT_MEMLOCK in bytes; None: unlimited


def read_host(root: Path = Path("/")) -> HostInfo:
    cpuinfo = read_text(root / "proc/cpuinfo") or ""
    cpus = sum(1 for line in cpuinfo.splitlines() if line.startswith("processor")) or os.cpu_count() or 0
    mem = None
    for line in (read_text(root / "proc/meminfo") or "").splitlines():
        if line.startswith("MemTotal:"):
            mem = int(line.split()[1]) * 1024
    nodes = [d for d in sorted_dirs(root / "sys/devices/system/node")
             if d.name.startswith("node") and d.name[4:].isdigit()]
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return HostInfo(cpus=cpus, mem_bytes=mem, numa_nodes=len(nodes),
                    memlock=None if soft == resource.RLIM_INFINITY else soft)


def host_findings(info: HostInfo) -> list[Finding]:
    mem = f"{info.mem_bytes / GIB:.0f} GiB memory" if info.mem_bytes else "memory unknown"
    found = [Finding("info", f"{info.cpus} CPUs, {mem}, {info.numa_nodes} NUMA node(s)",
                     {"cpus": info.cpus, "mem_bytes": info.mem_bytes, "numa_nodes": info.numa_nodes})]
    if info.memlock is None:
        found.append(Finding("info", "locked memory: unlimited", {"memlock": "unlimited"}))
    else:
        found.append(Finding(
            "warn", f"locked-memory limit is {info.memlock // 1024} KiB: RDMA KV transfer (Mooncake, Mori) pins the "
            "KV cache's memory; set `ulimit -l unlimited` (docker run --ulimit memlock=-1)",
            {"memlock": info.memlock}))
    return found
