"""Facts about the host the recipe rules need, read once at start (the only I/O of the recipes).

- ROCm: ``HIP_PLATFORM`` (``amd`` = ROCm, ``nvidia`` = HIP on CUDA: not ROCm), else ``ROCM_PATH``
  set, else ``/opt/rocm`` or ``/dev/kfd`` (the amdgpu compute device) present.
- RDMA ports: ``/sys/class/infiniband/<device>/ports/<port>/`` (``infera_common.host.rdma``).
- The interpreter that launches the engine (the agent's own, or the one ``--engine-python`` names,
  asked in a short subprocess: ``interpreter_probe``): whether it runs, which of the engines' launch
  modules it has, and the installed SGLang version (None when not installed).
- GPUs: how many the amdgpu driver's KFD topology lists (``infera_common.host.gpus``), when
  ``/dev/kfd`` is there.

``root`` relocates every path, so tests build a fake ``/sys`` and ``/opt`` under a temporary
directory. The rules never read the host themselves: they get a ``HostFacts``.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from infera_common.host.gpus import read_gpus
from infera_common.host.rdma import RdmaPort, read_rdma_ports
from infera_worker_agent import interpreter_probe
from infera_worker_agent.engine_cmd import LAUNCH_MODULES

@dataclass(frozen=True, slots=True)
class HostFacts:
    rocm: bool = False
    rdma_ports: tuple[RdmaPort, ...] = ()
    sglang_version: str | None = None  # None: not installed in the launching interpreter
    gpus: int | None = None  # GPUs in the amdgpu driver's KFD topology; None: no /dev/kfd, or none listed
    launch_modules: frozenset[str] | None = None  # the engines' launch modules it has; None: not asked
    interpreter_error: str | None = None  # why the launching interpreter could not be asked

    @property
    def active_ports(self) -> tuple[RdmaPort, ...]:
        return tuple(p for p in self.rdma_ports if p.active)


def is_rocm(env: Mapping[str, str], *, opt_rocm: bool, kfd: bool) -> bool:
    """Whether this is a ROCm host, from the environment and two paths' existence. Pure."""
    platform = env.get("HIP_PLATFORM", "").strip().lower()
    if platform:
        return platform == "amd"
    return bool(env.get("ROCM_PATH")) or opt_rocm or kfd


@dataclass(frozen=True, slots=True)
class Interpreter:
    """What ``interpreter_probe`` found in the interpreter that will launch the engine."""

    modules: frozenset[str] | None = None  # None: it could not be asked
    versions: Mapping[str, str] = field(default_factory=dict)
    error: str | None = None  # it could not be run, or did not answer: why


def probe_interpreter(python: str | None, modules: tuple[str, ...], dists: tuple[str, ...],
                      timeout: float = 30.0) -> Interpreter:
    """Ask ``python`` (None: this interpreter, in process) which of ``modules`` it has and the
    versions of ``dists``."""
    if python is None:
        found = interpreter_probe.probe(list(modules), list(dists))
        return Interpreter(frozenset(found["modules"]), found["versions"])
    # as ``-c`` source, so that its sys.path starts as ``python -m`` starts the engine's (the working
    # directory), not with this package's directory
    source = Path(interpreter_probe.__file__).read_text()
    try:
        out = subprocess.run([python, "-c", source, *modules, "--", *dists],
                             capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return Interpreter(error=str(exc) or type(exc).__name__)
    if out.returncode != 0:
        tail = (out.stderr.strip().splitlines() or [f"exit code {out.returncode}"])[-1]
        return Interpreter(error=tail[:300])
    try:
        found = json.loads(out.stdout)
        return Interpreter(frozenset(found["modules"]), dict(found["versions"]))
    except (ValueError, KeyError, TypeError):
        return Interpreter(error=f"unexpected answer {out.stdout[:100]!r}")


def probe_host(
    env: Mapping[str, str], root: Path = Path("/"), version_of: Callable[[str], str | None] | None = None,
    *, python: str | None = None,
) -> HostFacts:
    """The host's facts; installed versions from ``version_of`` (then the launch modules are not
    asked for), else from the interpreter ``python`` (``--engine-python``), else from this one."""
    launch_modules, error = None, None
    if version_of is None:
        found = probe_interpreter(python, tuple(m for ms in LAUNCH_MODULES.values() for m in ms), ("sglang",))
        version_of, launch_modules, error = found.versions.get, found.modules, found.error
    return HostFacts(
        rocm=is_rocm(env, opt_rocm=(root / "opt/rocm").exists(), kfd=(root / "dev/kfd").exists()),
        rdma_ports=read_rdma_ports(root / "sys/class/infiniband"),
        sglang_version=version_of("sglang"),
        gpus=kfd_gpu_count(root),
        launch_modules=launch_modules,
        interpreter_error=error,
    )


def kfd_gpu_count(root: Path) -> int | None:
    host = read_gpus(root)
    return len(host.gpus) if host.kfd and host.gpus else None
