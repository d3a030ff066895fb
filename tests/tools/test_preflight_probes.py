"""The preflight's probes on a node's /proc and /sys laid out under a temporary root."""

import sys

import pytest

from infera.tools.preflight.probe_gpu import firmware_findings, gpu_findings, topology_findings
from infera.tools.preflight.probe_host import HostInfo, host_findings, read_host
from infera.tools.preflight.probe_network import fabric_findings, network_findings, read_network
from infera.tools.preflight.probe_perf import fleet_probe, gpu_torch, outliers, run_gpu_probe
from infera.tools.preflight.probe_storage import measure, pick_mount, run_storage, storage_findings
from infera_common.host.gpus import gfx_name, read_gpus
from tests.tools.fake_node import fake_node

ACTIVE, DOWN = "4: ACTIVE", "1: DOWN"


def levels(found):
    return [f.level for f in found]


def test_eight_mi300x_gpus_are_read_from_the_kfd_topology(tmp_path):
    host = read_gpus(fake_node(tmp_path))
    assert [g.node for g in host.gpus] == list(range(1, 9))  # the CPU node 0 is not a GPU
    assert {g.gfx for g in host.gpus} == {"gfx942"} and host.driver == "6.10.5"
    assert host.gpus[0].vram_bytes == 192 << 30 and host.gpus[0].pci == "0000:10:00.0"
    assert [g.numa for g in host.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    [found] = gpu_findings(host, {})
    assert found.level == "info" and found.message.startswith("8 GPUs: gfx942 ×8; VRAM 192 GiB each")
    assert found.details == {"gpu_count": 8, "gfx": "gfx942", "driver": "6.10.5"}


def test_gfx_names():
    assert (gfx_name(90402), gfx_name(90500), gfx_name(90010)) == ("gfx942", "gfx950", "gfx90a")


def test_no_kfd_device_or_no_gpu_fails_saying_what_to_pass(tmp_path):
    [found] = gpu_findings(read_gpus(fake_node(tmp_path / "a", kfd=False)), {})
    assert found.level == "fail" and "--device /dev/kfd --device /dev/dri" in found.message
    [found] = gpu_findings(read_gpus(fake_node(tmp_path / "b", gpus=0)), {})
    assert found.level == "fail" and "no GPU in the KFD topology" in found.message


def test_mixed_gpus_and_a_visible_devices_mask_are_reported(tmp_path):
    root = fake_node(tmp_path, gpus=2)
    (root / "sys/class/kfd/kfd/topology/nodes/2/properties").write_text("gfx_target_version 90500\n")
    found = gpu_findings(read_gpus(root), {"HIP_VISIBLE_DEVICES": "0,1"})
    assert levels(found) == ["info", "warn", "info"]
    assert "different kinds" in found[1].message and "HIP_VISIBLE_DEVICES=0,1" in found[2].message


def test_a_pair_without_xgmi_and_an_unbalanced_numa_spread_warn(tmp_path):
    assert levels(topology_findings(read_gpus(fake_node(tmp_path / "ok")))) == ["info", "info"]
    host = read_gpus(fake_node(tmp_path / "bad", no_xgmi=((3, 7),), numa_of=lambda i: 0 if i < 6 else 1))
    pcie, numa = topology_findings(host)
    assert pcie.level == "warn" and "KFD nodes 3-7" in pcie.message and pcie.details == {"pcie_only_pairs": 1}
    assert numa.level == "warn" and numa.message == "GPUs per NUMA node: NUMA 0: 6, NUMA 1: 2"


def test_firmware_that_differs_between_gpus_warns(tmp_path):
    assert firmware_findings(read_gpus(fake_node(tmp_path / "a")))[0].details == {"mec": "0x000000a6"}
    [found] = firmware_findings(read_gpus(fake_node(tmp_path / "b", gpus=2, mec=("0xa6", "0xa4"))))
    assert found.level == "warn" and "0xa4" in found.message


def test_rdma_ports_active_down_and_absent(tmp_path):
    net = read_network(fake_node(tmp_path / "a", rdma={"ionic_0": ACTIVE, "ionic_1": DOWN}))
    found = network_findings(net)
    assert levels(found) == ["info", "warn", "info"]
    assert "eth0 (up, mtu 1500)" in found[0].message and "lo" not in found[0].message
    assert "ionic_1/1" in found[1].message and found[2].message == "1 of 2 RDMA port(s) active: ionic_0/1"
    [fabric] = fabric_findings(net)
    assert fabric.details == {"port": "ionic_0/1", "link_layer": "Ethernet", "ipv4_gids": ["10.0.0.1"], "mtu": 9000}
    found = network_findings(read_network(fake_node(tmp_path / "b")))
    assert found[-1].level == "warn" and "--disaggregation-allow-tcp" in found[-1].message


def test_the_locked_memory_limit_rdma_needs(tmp_path):
    info = read_host(fake_node(tmp_path))
    assert (info.cpus, info.mem_bytes, info.numa_nodes) == (64, 1584000000 * 1024, 2)
    assert levels(host_findings(HostInfo(64, None, 2, memlock=None))) == ["info", "info"]
    limited = host_findings(HostInfo(64, None, 2, memlock=8 << 20))
    assert limited[1].level == "warn" and "ulimit -l unlimited" in limited[1].message


def test_storage_picks_the_roomiest_block_device_and_measures_it(tmp_path):
    mounts = ("overlay / overlay rw 0 0\n/dev/nvme0n1p1 /boot ext4 rw 0 0\n/dev/md0 /data xfs rw 0 0\n"
              "tmpfs /dev/shm tmpfs rw 0 0\n")
    free = {"/boot": 1 << 30, "/data": 7 << 40, "/": 9 << 40, "/dev/shm": 9 << 40}
    assert pick_mount(mounts, free.get) == "/data"
    write, read = measure(str(tmp_path), 0.01)
    assert write > 0 and read > 0 and list(tmp_path.iterdir()) == []  # its file is gone
    found = run_storage(str(tmp_path), 0.01)
    assert levels(found) == ["info", "info"] and "write" in found[1].message
    assert levels(run_storage(str(tmp_path / "nope"), 0.01)) == ["fail"]
    assert "--storage-gb 0" in storage_findings("/data", 1 << 40, 0, None)[1].message
    assert storage_findings("/data", 1 << 30, 4, None)[1].level == "warn"  # too little room to measure 4 GiB


def test_gpu_measurements_without_pytorch_say_why(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    assert gpu_torch()[0] is None
    [found] = run_gpu_probe("compute")
    assert found.level == "info" and "inside the engine container" in found.message


def test_a_gpu_below_its_siblings_is_the_finding():
    found = outliers("bf16 GEMM", "TFLOPS", {"gpu0": 1300.0, "gpu1": 1310.0, "gpu2": 1000.0})
    assert levels(found) == ["info", "warn"] and "gpu2 reaches 1,000 TFLOPS" in found[1].message


@pytest.mark.parametrize("world,level", [(1, "info"), (2, "warn")])
def test_probes_across_nodes_are_not_built_and_say_so(world, level):
    [found] = fleet_probe("netperf", world)
    assert found.level == level and ("ib_write_bw" in found.message if world > 1 else "one node" in found.message)
