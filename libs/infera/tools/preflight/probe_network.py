"""The network and fabric probes: the interfaces in ``/sys/class/net`` and the RDMA ports in
``/sys/class/infiniband`` (read as the worker-agent's PD preflight reads them,
``host_probe.read_rdma_ports``). ``read_network`` reads; the ``*_findings`` functions decide."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from infera.tools.preflight.finding import Finding
from infera_common.host.rdma import RdmaPort, gid_ipv4, read_rdma_ports
from infera_common.host.sysfs import read_text, sorted_dirs


@dataclass(frozen=True, slots=True)
class Nic:
    name: str
    state: str  # operstate: up, down, unknown
    mtu: int | None
    physical: bool  # backed by a device (not a bridge, veth or tunnel)


@dataclass(frozen=True, slots=True)
class Network:
    nics: tuple[Nic, ...]
    rdma: tuple[RdmaPort, ...]
    rdma_mtu: dict[str, int]  # RDMA device -> the MTU of its network interface


def read_network(root: Path = Path("/")) -> Network:
    nics = []
    for d in sorted_dirs(root / "sys/class/net"):
        if d.name == "lo":
            continue
        mtu = read_text(d / "mtu")
        nics.append(Nic(name=d.name, state=read_text(d / "operstate") or "unknown",
                        mtu=int(mtu) if mtu and mtu.isdigit() else None, physical=(d / "device").exists()))
    rdma_mtu = {}
    for dev in sorted_dirs(root / "sys/class/infiniband"):
        for net in sorted_dirs(dev / "device/net"):
            mtu = read_text(net / "mtu")
            if mtu and mtu.isdigit():
                rdma_mtu[dev.name] = int(mtu)
    return Network(nics=tuple(nics), rdma=read_rdma_ports(root / "sys/class/infiniband"), rdma_mtu=rdma_mtu)


def network_findings(net: Network) -> list[Finding]:
    up = [n for n in net.nics if n.state == "up"]
    found = [Finding("info", f"{len(net.nics)} network interface(s), {len(up)} up: "
                     + ", ".join(f"{n.name} ({n.state}, mtu {n.mtu})"
                                 for n in net.nics if n.physical or n.state == "up"),
                     {"nics": len(net.nics)})]
    if not net.rdma:
        found.append(Finding("warn", "no RDMA device (/sys/class/infiniband): a prefill/decode leg on this node is "
                             "refused by the worker-agent unless --disaggregation-allow-tcp (KV transfer over TCP)",
                             {"rdma_ports": 0}))
        return found
    down = [p for p in net.rdma if not p.active]
    active = [p for p in net.rdma if p.active]
    if down:
        found.append(Finding("warn", f"RDMA port(s) not ACTIVE: {', '.join(p.name for p in down)}",
                             {"inactive": [p.name for p in down]}))
    level = "info" if active else "warn"
    found.append(Finding(level, f"{len(active)} of {len(net.rdma)} RDMA port(s) active"
                         + (f": {', '.join(p.name for p in active)}" if active else ""),
                         {"rdma_ports": len(net.rdma), "active": len(active)}))
    return found


def fabric_findings(net: Network) -> list[Finding]:
    active = [p for p in net.rdma if p.active]
    if not active:
        return [Finding("info", "no active RDMA port: no fabric to describe")]
    found = []
    for p in active:
        ipv4 = sorted({ip for ip in (gid_ipv4(g) for g in p.gids) if ip})
        mtu = net.rdma_mtu.get(p.device)
        found.append(Finding("info", f"{p.name}: {p.link_layer or 'link layer unknown'}, RoCE v2 IPv4 GIDs "
                             f"{', '.join(ipv4) or 'none'}, MTU {mtu or 'unknown'}",
                             {"port": p.name, "link_layer": p.link_layer, "ipv4_gids": ipv4, "mtu": mtu}))
    mtus = {net.rdma_mtu[p.device] for p in active if p.device in net.rdma_mtu}
    if len(mtus) > 1:
        found.append(Finding("warn", f"the active RDMA ports' interfaces have different MTUs: {sorted(mtus)}"))
    return found
