"""The host's AMD GPUs, read from what the amdgpu driver publishes in sysfs: the KFD topology
(``/sys/class/kfd/kfd/topology/nodes/<n>/``: ``gpu_id``, ``properties``, ``mem_banks``,
``io_links``), the DRM cards' firmware versions and the PCI devices' NUMA nodes. No ROCm tool or
library is needed. The worker-agent counts them (``HostFacts.gpus``); the node preflight
(``infera.tools.preflight``) reports them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from infera_common.host.sysfs import read_text, sorted_dirs

#: The environment variables that narrow the GPUs a process sees (ROCm runtime, HIP, CUDA names).
VISIBLE_ENV = ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")

KFD_NODES = "sys/class/kfd/kfd/topology/nodes"
LINK_XGMI = 11  # io_links type (HSA_IOLINK_TYPE_XGMI); 2 is PCIe
FB_HEAPS = (1, 2)  # mem_banks heap_type: frame buffer, public and private


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
            xgmi_to=tuple(sorted(link["node_to"] for link in links
                                 if link.get("type") == LINK_XGMI and "node_to" in link)),
        ))
    mec = []
    for card in sorted_dirs(root / "sys/class/drm"):
        if card.name.startswith("card") and "-" not in card.name and read_text(card / "device/vendor") == "0x1002":
            version = read_text(card / "device/fw_version/mec_fw_version")
            if version is not None:
                mec.append(version)
    return GpuHost(kfd=(root / "dev/kfd").exists(), gpus=tuple(gpus),
                   driver=read_text(root / "sys/module/amdgpu/version"), mec_firmware=tuple(mec))
