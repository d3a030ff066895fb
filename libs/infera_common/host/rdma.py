"""The host's RDMA ports, read from sysfs: ``/sys/class/infiniband/<device>/ports/<port>/`` with
``state`` (``4: ACTIVE``), ``link_layer`` (``Ethernet`` = RoCE, ``InfiniBand``) and the GID table
``gids/<index>``. The worker-agent's recipe rules use them (``HostFacts.rdma_ports``); the node
preflight (``infera.tools.preflight``) reports them."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

from infera_common.host.sysfs import read_text, sorted_dirs

#: How many GID-table entries per port are read: the tables hold up to 256 (mostly empty); the
#: RoCE v2 IPv4 GIDs that matter sit in the first few.
MAX_GIDS = 32


@dataclass(frozen=True, slots=True)
class RdmaPort:
    device: str  # e.g. mlx5_0, ionic_0, bnxt_re0
    port: int
    active: bool
    link_layer: str | None = None  # "Ethernet" (RoCE) or "InfiniBand"; None when unknown
    gids: tuple[str, ...] = ()  # the GID table by index ("" for an unreadable entry)

    @property
    def name(self) -> str:
        return f"{self.device}/{self.port}"

    def ipv4_gid(self, index: int) -> str | None:
        """The IPv4 address of GID ``index`` when it is a RoCE v2 IPv4-mapped GID (``::ffff:a.b.c.d``)."""
        if not 0 <= index < len(self.gids):
            return None
        return gid_ipv4(self.gids[index])


def gid_ipv4(gid: str) -> str | None:
    try:
        mapped = ipaddress.IPv6Address(gid.strip()).ipv4_mapped
    except ValueError:
        return None
    return str(mapped) if mapped is not None and not mapped.is_unspecified else None



def read_rdma_ports(base: Path) -> tuple[RdmaPort, ...]:
    """Every port of every RDMA device under ``base`` (``/sys/class/infiniband``), sorted."""
    ports = []
    for device in sorted_dirs(base):
        for port_dir in sorted_dirs(device / "ports"):
            if not port_dir.name.isdigit():
                continue
            state = read_text(port_dir / "state") or ""
            ports.append(RdmaPort(
                device=device.name,
                port=int(port_dir.name),
                active="ACTIVE" in state.upper(),
                link_layer=read_text(port_dir / "link_layer"),
                gids=_read_gids(port_dir / "gids"),
            ))
    return tuple(ports)


def _read_gids(gid_dir: Path) -> tuple[str, ...]:
    try:
        indices = sorted(int(p.name) for p in gid_dir.iterdir() if p.name.isdigit())
    except OSError:
        return ()
    table = [""] * min(len(indices) and indices[-1] + 1, MAX_GIDS)
    for i in indices:
        if i < MAX_GIDS:
            table[i] = read_text(gid_dir / str(i)) or ""
    return tuple(table)
