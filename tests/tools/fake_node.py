"""A GPU node's /proc and /sys as files under a temporary root: what the preflight's probes read."""

from __future__ import annotations

from pathlib import Path

XGMI, PCIE = 11, 2
GIB = 1 << 30


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def kv(**props: int) -> str:
    return "".join(f"{k} {v}\n" for k, v in props.items())


def fake_node(root: Path, *, gpus: int = 8, gfx: int = 90402, vram_gib: int = 192, no_xgmi: tuple = (),
              mec: tuple[str, ...] | None = None, rdma: dict[str, str] | None = None, kfd: bool = True,
              numa_of=lambda i: i // 4, driver: str | None = "6.10.5") -> Path:
    """``gpus`` GPUs (KFD nodes 1..gpus after CPU node 0), fully meshed by xGMI except the
    ``no_xgmi`` pairs (PCIe there); ``rdma`` maps RDMA device -> port state."""
    write(root / "proc/cpuinfo", "".join(f"processor\t: {i}\n\n" for i in range(64)))
    write(root / "proc/meminfo", "MemTotal:       1584000000 kB\n")
    for n in range(2):
        (root / f"sys/devices/system/node/node{n}").mkdir(parents=True)
    if kfd:
        write(root / "dev/kfd", "")
    nodes = root / "sys/class/kfd/kfd/topology/nodes"
    write(nodes / "0/gpu_id", "0")
    write(nodes / "0/properties", kv(cpu_cores_count=64, simd_count=0))
    for i in range(gpus):
        node = nodes / str(i + 1)
        bus = 0x10 + 0x10 * i
        write(node / "gpu_id", str(1000 + i))
        write(node / "properties", kv(simd_count=1216, gfx_target_version=gfx, domain=0, location_id=bus << 8))
        write(node / "mem_banks/0/properties", kv(heap_type=1, size_in_bytes=vram_gib * GIB))
        for j in range(gpus):
            if j != i:
                kind = PCIE if (i + 1, j + 1) in no_xgmi or (j + 1, i + 1) in no_xgmi else XGMI
                write(node / f"io_links/{j}/properties", kv(type=kind, node_from=i + 1, node_to=j + 1))
        write(root / f"sys/bus/pci/devices/0000:{bus:02x}:00.0/numa_node", str(numa_of(i)))
        card = root / f"sys/class/drm/card{i}/device"
        write(card / "vendor", "0x1002")
        write(card / "fw_version/mec_fw_version", (mec or ("0x000000a6",) * gpus)[i])
    if driver:
        write(root / "sys/module/amdgpu/version", driver)
    write(root / "sys/class/net/lo/mtu", "65536")
    write(root / "sys/class/net/eth0/mtu", "1500")
    write(root / "sys/class/net/eth0/operstate", "up")
    (root / "sys/class/net/eth0/device").mkdir()
    for k, (device, state) in enumerate((rdma or {}).items()):
        port = root / f"sys/class/infiniband/{device}/ports/1"
        write(port / "state", state)
        write(port / "link_layer", "Ethernet")
        write(port / "gids/0", "fe80:0000:0000:0000:0000:0000:0000:0001")
        write(port / "gids/1", f"0000:0000:0000:0000:0000:ffff:0a00:00{k + 1:02x}")
        write(root / f"sys/class/infiniband/{device}/device/net/rdma{k}/mtu", "9000")
    return root
