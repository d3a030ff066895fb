"""The gpu, firmware and topology probes: what ``infera_common.host.gpus.read_gpus`` reads
from the amdgpu driver's sysfs (the KFD topology, the cards' firmware versions, the GPUs' NUMA
nodes), judged here."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from infera.tools.preflight.finding import Finding
from infera_common.host.gpus import VISIBLE_ENV
from infera_common.host.gpus import GpuHost

GIB = 1 << 30


def gpu_findings(host: GpuHost, env: Mapping[str, str]) -> list[Finding]:
    if not host.kfd:
        return [Finding("fail", "no /dev/kfd: the amdgpu driver is not loaded, or the container was started without "
                        "--device /dev/kfd --device /dev/dri; ROCm engines cannot run here", {"gpu_count": 0})]
    if not host.gpus:
        return [Finding("fail", "no GPU in the KFD topology (/sys/class/kfd/kfd/topology/nodes)", {"gpu_count": 0})]
    gfx = Counter(g.gfx for g in host.gpus)
    vram = Counter(g.vram_bytes for g in host.gpus)
    found = [Finding("info", f"{len(host.gpus)} GPUs: " + ", ".join(f"{name} ×{n}" for name, n in gfx.items())
                     + f"; VRAM {max(vram) / GIB:.0f} GiB each; amdgpu driver {host.driver or 'in-kernel'}",
                     {"gpu_count": len(host.gpus), "gfx": ",".join(sorted(gfx)), "driver": host.driver or "in-kernel"})]
    if len(gfx) > 1:
        found.append(Finding("warn", f"GPUs of different kinds on one node: {dict(gfx)}; an engine's GPUs must match"))
    if len(vram) > 1:
        found.append(Finding("warn", "GPUs with different VRAM: " + ", ".join(
            f"node {g.node} {g.vram_bytes / GIB:.0f} GiB" for g in host.gpus)))
    for name in VISIBLE_ENV:
        if env.get(name):
            found.append(Finding("info", f"{name}={env[name]}: the engines see only those GPUs"))
    return found


def firmware_findings(host: GpuHost) -> list[Finding]:
    if not host.mec_firmware:
        return [Finding("info", "no amdgpu card publishes its firmware versions "
                        "(/sys/class/drm/card*/device/fw_version)")]
    versions = Counter(host.mec_firmware)
    if len(versions) > 1:
        return [Finding("warn", f"MEC firmware differs between this node's GPUs: {dict(versions)}")]
    return [Finding("info", f"MEC firmware {host.mec_firmware[0]} on {len(host.mec_firmware)} GPUs",
                    {"mec": host.mec_firmware[0]})]


def topology_findings(host: GpuHost) -> list[Finding]:
    gpus = host.gpus
    if len(gpus) < 2:
        return [Finding("info", f"{len(gpus)} GPU(s): no links between GPUs to check")]
    missing = [(a.node, b.node) for i, a in enumerate(gpus) for b in gpus[i + 1:]
               if b.node not in a.xgmi_to and a.node not in b.xgmi_to]
    found = []
    if missing:
        pairs = ", ".join(f"{a}-{b}" for a, b in missing[:8]) + (" …" if len(missing) > 8 else "")
        found.append(Finding("warn", f"{len(missing)} GPU pair(s) without an xGMI link (KFD nodes {pairs}): tensor "
                             "parallelism across them runs over PCIe", {"pcie_only_pairs": len(missing)}))
    else:
        found.append(Finding("info", f"every pair of the {len(gpus)} GPUs has an xGMI link"))
    per_numa = Counter(g.numa for g in gpus if g.numa is not None)
    if per_numa:
        spread = ", ".join(f"NUMA {n}: {c}" for n, c in sorted(per_numa.items()))
        level = "warn" if max(per_numa.values()) - min(per_numa.values()) > 1 else "info"
        found.append(Finding(level, f"GPUs per NUMA node: {spread}"))
    return found
