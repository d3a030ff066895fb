"""``python -m infera.tools.preflight [probe flags] [--dump-path D] ...``: probe this node, write
``D/<host>.json``; the reporting host (rank 0; the only one without SLURM) renders
``D/<report-file-name>.html`` from every host's file. Under SLURM (``srun`` one task per node,
one shared ``--dump-path``) each task probes its node and rank 0 waits for all of them.

The host name is ``--host-name``, else ``PREFLIGHT_HOST`` (the runbooks' container environment), else
``SLURMD_NODENAME``, else ``HOSTNAME``, else the system's (inside a container the hostname is the
container's id: pass the node's). ``--image`` (else ``PREFLIGHT_IMAGE``) names the engine image in the
report.
"""

from __future__ import annotations

import functools
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from infera.tools.preflight.finding import Finding, worst_of
from infera.tools.preflight.probe_gpu import firmware_findings, gpu_findings, topology_findings
from infera.tools.preflight.probe_host import host_findings, read_host
from infera.tools.preflight.probe_network import fabric_findings, network_findings, read_network
from infera.tools.preflight.probe_perf import fleet_probe, run_gpu_probe
from infera.tools.preflight.probe_storage import run_storage
from infera.tools.preflight.report import consistency, load_hosts, render, write_host
from infera.tools.preflight.settings import FLEET_PROBES, PreflightSettings
from infera_common.host.gpus import read_gpus
from infera_common.settings import parse_cli

PROG = "infera.tools.preflight"


def host_name(settings: PreflightSettings, env: Mapping[str, str]) -> str:
    return (settings.host_name or env.get("PREFLIGHT_HOST") or env.get("SLURMD_NODENAME") or env.get("HOSTNAME")
            or socket.gethostname())


def rank_world(env: Mapping[str, str]) -> tuple[int, int]:
    return int(env.get("SLURM_PROCID") or 0), int(env.get("SLURM_NNODES") or env.get("SLURM_NTASKS") or 1)


def node_probes(settings: PreflightSettings, env: Mapping[str, str],
                root: Path) -> dict[str, Callable[[], list[Finding]]]:
    """Every probe of this node, by name (each reads what it needs when called, the GPUs and the
    network once for the probes that share them)."""
    gpus = functools.cache(lambda: read_gpus(root))
    network = functools.cache(lambda: read_network(root))
    return {
        "host": lambda: host_findings(read_host(root)),
        "gpu": lambda: gpu_findings(gpus(), env),
        "network": lambda: network_findings(network()),
        "firmware": lambda: firmware_findings(gpus()),
        "storage": lambda: run_storage(settings.storage_path, settings.storage_gb, root),
        "compute": lambda: run_gpu_probe("compute"),
        "hbm": lambda: run_gpu_probe("hbm"),
        "p2p": lambda: run_gpu_probe("p2p"),
        "topology": lambda: topology_findings(gpus()),
        "fabric": lambda: fabric_findings(network()),
    }


def collect(settings: PreflightSettings, env: Mapping[str, str], host: str, world: int,
            root: Path = Path("/")) -> dict[str, list[Finding]]:
    probes = node_probes(settings, env, root)
    sections = {}
    for name in settings.selected():
        print(f"[preflight] [{host}] {name}...", file=sys.stderr)
        try:
            sections[name] = fleet_probe(name, world) if name in FLEET_PROBES else probes[name]()
        except Exception as exc:  # one broken probe must not cost the others
            sections[name] = [Finding("fail", f"the {name} probe failed: {type(exc).__name__}: {exc}")]
        for f in sections[name]:
            if f.level != "info":
                print(f"[preflight] [{host}] {f.level.upper()} {name}: {f.message}", file=sys.stderr)
    return sections


def wait_for_hosts(dump: Path, count: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while (have := len(list(dump.glob("*.json")))) < count and time.monotonic() < deadline:
        time.sleep(1.0)
    return have


def main(argv: list[str] | None = None, env: Mapping[str, str] | None = None, root: Path = Path("/")) -> int:
    settings, _ = parse_cli(PreflightSettings, argv, prog=PROG, description=__doc__ or "")
    env = os.environ if env is None else env
    dump = Path(settings.dump_path)
    rank, world = rank_world(env)
    if not settings.render_only:
        host = host_name(settings, env)
        sections = collect(settings, env, host, world, root)
        path = write_host(dump, host, settings.image or env.get("PREFLIGHT_IMAGE") or "unknown", sections)
        level = worst_of(sections)
        print(f"[preflight] [{host}] rank {rank}/{world}: {level}; wrote {path}", file=sys.stderr)
        if settings.collect_only or rank != 0:
            return 2 if level == "fail" else 0
        if world > 1 and (have := wait_for_hosts(dump, world, settings.wait_timeout)) < world:
            print(f"[preflight] only {have} of {world} hosts reported within {settings.wait_timeout:g}s",
                  file=sys.stderr)
    hosts = load_hosts(dump)
    if not hosts:
        print(f"[preflight] no host's JSON in {dump}: nothing to report", file=sys.stderr)
        return 2
    consistency(hosts)
    report = dump / f"{settings.report_file_name}.html"
    report.write_text(render(hosts))
    print(f"[preflight] report on {len(hosts)} host(s): {report}", file=sys.stderr)
    return 2 if any(worst_of(h["sections"]) == "fail" for h in hosts) else 0  # this host's file is among them
