"""The compute, hbm and p2p probes (PyTorch on the node's GPUs; ROCm's PyTorch answers through the
``torch.cuda`` API) and the probes across nodes.

Without PyTorch, or without a GPU it can see, the GPU probes say so and measure nothing: run the
preflight inside the engine's container, where both are. Each GPU's figure is compared with the
node's median (``outliers``): a GPU well below its siblings is the finding, not an absolute floor.
The probes across nodes (netperf, mooncake, mori) are not built here: on one node they have
nothing to measure, and on several they say which tool measures it.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from infera.tools.preflight.finding import Finding, skipped

GEMM_N = 8192
HBM_BYTES = 1 << 30
P2P_BYTES = 256 << 20
REPEATS = 10
SLOW = 0.9  # below this share of the node's median: warn


def gpu_torch() -> tuple[Any | None, str]:
    """PyTorch when it sees at least one GPU, else None and why."""
    try:
        import torch
    except ImportError:
        return None, "PyTorch is not installed here; run the preflight inside the engine container"
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return None, "PyTorch sees no GPU"
    return torch, ""


def outliers(kind: str, unit: str, figures: dict[str, float]) -> list[Finding]:
    """One finding with every figure, and a warning per figure below ``SLOW`` × the median."""
    median = statistics.median(figures.values())
    found = [Finding("info", f"{kind}: " + ", ".join(f"{k} {v:,.0f}" for k, v in figures.items()) + f" {unit}",
                     {"figures": {k: round(v, 1) for k, v in figures.items()}, "unit": unit})]
    found += [Finding("warn", f"{kind}: {k} reaches {v:,.0f} {unit}, below {SLOW:.0%} of the node's median "
                      f"({median:,.0f})") for k, v in figures.items() if v < SLOW * median]
    return found


def _timed(torch: Any, device: int, work) -> float:
    """Seconds per call of ``work`` on ``device``: one warm-up, then ``REPEATS`` calls."""
    with torch.cuda.device(device):
        work()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(REPEATS):
            work()
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / REPEATS


def run_compute(torch: Any) -> list[Finding]:
    figures = {}
    for d in range(torch.cuda.device_count()):
        a = torch.randn(GEMM_N, GEMM_N, dtype=torch.bfloat16, device=f"cuda:{d}")
        seconds = _timed(torch, d, lambda a=a: a @ a)
        figures[f"gpu{d}"] = 2 * GEMM_N ** 3 / seconds / 1e12
    return outliers("bf16 GEMM", "TFLOPS", figures)


def run_hbm(torch: Any) -> list[Finding]:
    figures = {}
    for d in range(torch.cuda.device_count()):
        src = torch.empty(HBM_BYTES, dtype=torch.uint8, device=f"cuda:{d}")
        dst = torch.empty_like(src)
        seconds = _timed(torch, d, lambda s=src, t=dst: t.copy_(s))
        figures[f"gpu{d}"] = 2 * HBM_BYTES / seconds / 1e9  # read and write
    return outliers("HBM copy", "GB/s", figures)


def run_p2p(torch: Any) -> list[Finding]:
    n = torch.cuda.device_count()
    if n < 2:
        return [skipped("GPU to GPU copy", "one GPU")]
    figures = {}
    for i in range(n):
        src = torch.empty(P2P_BYTES, dtype=torch.uint8, device=f"cuda:{i}")
        for j in range(n):
            if i != j:
                dst = torch.empty(P2P_BYTES, dtype=torch.uint8, device=f"cuda:{j}")
                figures[f"{i}->{j}"] = P2P_BYTES / _timed(torch, i, lambda s=src, t=dst: t.copy_(s)) / 1e9
    return outliers("GPU to GPU copy", "GB/s", figures)


GPU_PROBES = {"compute": run_compute, "hbm": run_hbm, "p2p": run_p2p}
FLEET_TOOLS = {
    "netperf": "ib_write_bw (perftest) between each pair of nodes' NICs",
    "mooncake": "Mooncake's transfer_engine_bench between a prefill and a decode node",
    "mori": "Mori's IOEngine benchmark between two nodes",
}


def run_gpu_probe(name: str) -> list[Finding]:
    torch, why = gpu_torch()
    if torch is None:
        return [skipped(name, why)]
    return GPU_PROBES[name](torch)


def fleet_probe(name: str, world: int) -> list[Finding]:
    if world < 2:
        return [skipped(name, "one node: nothing to measure between nodes")]
    return [Finding("warn", f"{name}: not built into Infera's preflight; measure with {FLEET_TOOLS[name]}")]
