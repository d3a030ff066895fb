"""The host probe reads ROCm, RDMA ports and the SGLang version; here from a fake root directory."""

from pathlib import Path

import pytest

from infera_common.host.rdma import gid_ipv4
from infera_worker_agent.host_probe import is_rocm, probe_host
from infera_worker_agent.interpreter_probe import installed

IPV4_GID = "0000:0000:0000:0000:0000:ffff:c0a8:010b"  # ::ffff:192.168.1.11


def add_port(root: Path, device: str, port: int, state: str, gids: dict[int, str], link: str = "Ethernet") -> None:
    d = root / "sys/class/infiniband" / device / "ports" / str(port)
    (d / "gids").mkdir(parents=True)
    (d / "state").write_text(state + "\n")
    (d / "link_layer").write_text(link + "\n")
    for i in range(4):
        (d / "gids" / str(i)).write_text(gids.get(i, "0000:0000:0000:0000:0000:0000:0000:0000") + "\n")


def test_probe_reads_rdma_ports_states_and_gids(tmp_path):
    add_port(tmp_path, "ionic_10", 1, "4: ACTIVE", {1: IPV4_GID})
    add_port(tmp_path, "ionic_2", 1, "1: DOWN", {})
    add_port(tmp_path, "mlx5_0", 1, "4: ACTIVE", {}, link="InfiniBand")
    facts = probe_host({}, root=tmp_path, version_of=lambda dist: None)
    assert [(p.device, p.port, p.active, p.link_layer) for p in facts.rdma_ports] == [
        ("ionic_2", 1, False, "Ethernet"), ("ionic_10", 1, True, "Ethernet"), ("mlx5_0", 1, True, "InfiniBand")]
    assert facts.rdma_ports[1].ipv4_gid(1) == "192.168.1.11"
    assert [p.name for p in facts.active_ports] == ["ionic_10/1", "mlx5_0/1"]
    assert not facts.rocm and facts.sglang_version is None


def test_probe_on_a_machine_without_rdma_or_rocm(tmp_path):
    facts = probe_host({}, root=tmp_path, version_of=lambda dist: "0.5.19" if dist == "sglang" else None)
    assert (facts.rocm, facts.rdma_ports, facts.sglang_version) == (False, (), "0.5.19")


@pytest.mark.parametrize("env, opt_rocm, kfd, expected", [
    ({}, False, False, False),
    ({}, True, False, True),
    ({}, False, True, True),
    ({"ROCM_PATH": "/opt/rocm-7.2.4"}, False, False, True),
    ({"HIP_PLATFORM": "amd"}, False, False, True),
    ({"HIP_PLATFORM": "nvidia"}, True, False, False),  # HIP on CUDA is not ROCm
])
def test_rocm_detection(env, opt_rocm, kfd, expected):
    assert is_rocm(env, opt_rocm=opt_rocm, kfd=kfd) is expected


def test_probe_finds_rocm_from_opt_rocm(tmp_path):
    (tmp_path / "opt/rocm").mkdir(parents=True)
    assert probe_host({}, root=tmp_path, version_of=lambda dist: None).rocm


def test_gid_ipv4():
    assert gid_ipv4(IPV4_GID) == "192.168.1.11"
    assert gid_ipv4("fe80:0000:0000:0000:b226:28ff:fe2b:1c4e") is None
    assert gid_ipv4("0000:0000:0000:0000:0000:ffff:0000:0000") is None
    assert gid_ipv4("garbage") is None


def test_installed_versions_leave_out_a_missing_distribution():
    assert set(installed(["infera", "no-such-distribution-xyz"])) == {"infera"}
