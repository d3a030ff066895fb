"""The gpu, firmware and topology probes, from what the amdgpu driver publishes in sysfs: the KFD
topology (``/sys/class/kfd/kfd/topology/nodes/<n>/``: ``properties``, ``gpu_id``, ``mem_banks``,
``io_links``), the DRM cards' firmware versions and the PCI devices' NUMA nodes. No ROCm tool or
library is needed. ``read_gpus`` reads; the ``*_findings`` functions decide."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from infera.tools.preflight.finding import Finding
from infera_worker_agent.host_probe import read_text, sorted_dirs

KFD_NODES = "sys/class/kfd/kfd/topology/nodes"
LINK_XGMI = 11  # io_links type (HSA_IOLINK_TYPE_XGMI); 2 is PCIe
FB_HEAPS = (1, 2)  # mem_banks heap_type: frame buffer, public and private
VISIBLE_ENV = ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")
GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class Gpu:
    node: int  # the KFD node id
    gfx: str  # gfx942 (MI300X, MI325X), gfx950 (MI355X)
    vram_bytes: int
    pci: str | None  # 0000:c1:00.0
    numa: int | None
    xgmi_to: tuple[int, ...] = ()  # KFD nodes it has a direct xGMI link to


@dataclass(frozen=True, slots=True)
class GpuHost:
    kfd: bool  # /dev/kfd exists
    gpus: tuple[Gpu, ...]
    driver: str | None  # the amdgpu module's version (DKMS builds have one)
    mec_firmware: tuple[str, ...] = ()  # per amdgpu DRM card


def props(path: Path) -> dict[str, int]:
    """A KFD ``properties`` file: one ``name value`` pair a line."""
    out = {}
    for line in (read_text(path) or "").splitlines():
        name, _, value = line.partition(" ")
        try:
            out[name] = int(value)
        except ValueError:
            continue
    return out


def gfx_name(target_version: int) -> str:
    """``gfx_target_version`` 90402 -> ``gfx942`` (major, minor and stepping; the last two in hex)."""
    major, minor, step = target_version // 10000, target_version // 100 % 100, target_version % 100
    return f"gfx{major}{minor:x}{step:x}"


def pci_address(p: Mapping[str, int]) -> str | None:
    if "location_id" not in p:
        return None
    loc = p["location_id"]
    return f"{p.get('domain', 0):04x}:{loc >> 8:02x}:{loc >> 3 & 0x1f:02x}.{loc & 7}"


def read_gpus(root: Path = Path("/")) -> GpuHost:
    gpus = []
    for node in sorted_dirs(root / KFD_NODES):
        if not node.name.isdigit() or (read_text(node / "gpu_id") or "0") == "0":
            continue  # a CPU node
        p = props(node / "properties")
        vram = sum(b.get("size_in_bytes", 0) for b in (props(d / "properties") for d in sorted_dirs(node / "mem_banks"))
                   if b.get("heap_type") in FB_HEAPS)
        links = (props(d / "properties") for d in sorted_dirs(node / "io_links"))
        pci = pci_address(p)
        numa = read_text(root / "sys/bus/pci/devices" / pci / "numa_node") if pci else None
        gpus.append(Gpu(
            node=int(node.name), gfx=gfx_name(p.get("gfx_target_version", 0)), vram_bytes=vram, pci=pci,
            numa=int(numa) if numa is not None and numa.lstrip("-").isdigit() and int(numa) >= 0 else None,
            xgmi_to=tuple(sorted(link["node_to"] for link in links if link.get("type") == LINK_XGMI and "node_to" in link)),
        ))
    mec = []
    for card in sorted_dirs(root / "sys/class/drm"):
        if card.name.startswith("card") and "-" not in card.name and read_text(card / "device/vendor") == "0x1002":
            version = read_text(card / "device/fw_version/mec_fw_version")
            if version is not None:
                mec.append(version)
    return GpuHost(kfd=(root / "dev/kfd").exists(), gpus=tuple(gpus), driver=read_text(root / "sys/module/amdgpu/version"),
                   mec_firmware=tuple(mec))


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
        return [Finding("info", "no amdgpu card publishes its firmware versions (/sys/class/drm/card*/device/fw_version)")]
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
