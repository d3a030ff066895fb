"""How many GPUs the engine arguments ask of this node, against how many it can see. Pure.

An engine asked for more GPUs than the node shows it (a runbook's ``--tp 8`` on a node where a
GPU is missing, or where ``HIP_VISIBLE_DEVICES`` leaves four) fails only once its distributed
start-up runs, a minute or more into the launch. What each engine takes, read in their sources:

- SGLang 0.5.19: ``--tp-size`` × ``--pp-size`` GPUs at least, spread over ``--nnodes``, numbered
  from ``--base-gpu-id`` in steps of ``--gpu-id-step``. ``--dp-size`` ranks take a TP group each
  only without DP attention, which SGLang may turn on by itself for some models (the flag is
  ``resolvable``): they are not counted, so that no launch that would run is refused.
- vLLM 0.32: ``--tensor-parallel-size`` × ``--pipeline-parallel-size`` ×
  ``--prefill-context-parallel-size`` per DP rank, times the DP ranks this node runs
  (``--data-parallel-size-local``, else ``--data-parallel-size``; one with ``--data-parallel-rank``).
  Launches across nodes (``--nnodes`` above 1, the Ray or external-launcher executor) and
  ``--device-ids`` are left to vLLM: what one node holds of them is not read here.

The GPUs the node can see are those of the amdgpu driver's KFD topology (``infera_common.host.gpus``), as few as
the shortest of ``ROCR_VISIBLE_DEVICES``, ``HIP_VISIBLE_DEVICES`` and ``CUDA_VISIBLE_DEVICES``
(ROCm honours each). Without a KFD topology (no ROCm host, or the mock engine) nothing is checked.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from infera_common.host.gpus import VISIBLE_ENV
from infera_worker_agent.engine_cmd import flag_value, has_flag, vllm_flag_view

#: SGLang's names (``--tp`` is argparse's abbreviation of ``--tp-size``, which runbooks write)
SGLANG = {"tp": ("--tp-size", "--tensor-parallel-size", "--tp"), "pp": ("--pp-size", "--pipeline-parallel-size")}
VLLM = {"tp": ("--tensor-parallel-size", "-tp"), "pp": ("--pipeline-parallel-size", "-pp"),
        "pcp": ("--prefill-context-parallel-size", "-pcp"), "dp": ("--data-parallel-size", "-dp"),
        "dpl": ("--data-parallel-size-local", "-dpl")}


def visible_gpus(kfd_gpus: int, env: Mapping[str, str]) -> tuple[int, str]:
    """The GPUs an engine started with ``env`` sees, and why that many."""
    count, why = kfd_gpus, f"{kfd_gpus} in the KFD topology"
    for name in VISIBLE_ENV:
        value = env.get(name, "").strip()
        if value and len(value.split(",")) < count:
            count, why = len(value.split(",")), f"{name}={value}; {kfd_gpus} in the KFD topology"
    return count, why


def _int(args: Sequence[str], names: Sequence[str], default: int) -> int:
    value = flag_value(args, *names)
    return default if value is None else int(value)


def _product(sizes: Sequence[tuple[str, int]]) -> str:
    """``--tp-size 4 × --pp-size 2``: the sizes above one."""
    return " × ".join(f"{flag} {n}" for flag, n in sizes if n != 1) or "one GPU"


def gpus_needed(engine: str, engine_args: Sequence[str]) -> tuple[int, int, str] | None:
    """(how many GPUs the node must show: the highest GPU id used + 1, the first id used, the flags that
    make the count); None: not read here."""
    try:
        if engine == "sglang":
            args = list(engine_args)
            tp, pp = (_int(args, SGLANG[k], 1) for k in ("tp", "pp"))
            nnodes = _int(args, ("--nnodes",), 1)
            per_node = -(-tp * pp // max(nnodes, 1))
            step = _int(args, ("--gpu-id-step",), 1)
            base = _int(args, ("--base-gpu-id",), 0)
            how = _product((("--tp-size", tp), ("--pp-size", pp)))
            if nnodes > 1:
                how += f" over --nnodes {nnodes}"
            last = base + (per_node - 1) * step
            return (last + 1, base, how + (f", GPU ids {base}..{last}" if base or step != 1 else ""))
        if engine == "vllm":
            args = vllm_flag_view(engine_args)
            if (_int(args, ("--nnodes", "-n"), 1) > 1 or has_flag(args, "--device-ids")
                    or flag_value(args, "--distributed-executor-backend") in ("ray", "external_launcher")):
                return None
            tp, pp, pcp, dp = (_int(args, VLLM[k], 1) for k in ("tp", "pp", "pcp", "dp"))
            local = 1 if has_flag(args, "--data-parallel-rank", "-dpn") else _int(args, VLLM["dpl"], dp)
            dp_flag = "--data-parallel-size-local" if has_flag(args, *VLLM["dpl"]) else "--data-parallel-size"
            how = _product((("--tensor-parallel-size", tp), ("--pipeline-parallel-size", pp),
                            ("--prefill-context-parallel-size", pcp), (dp_flag, local)))
            return tp * pp * pcp * local, 0, how
    except ValueError:  # not a number: the engine's own parser says so
        return None
    return None


def gpu_count_problem(engine: str, engine_args: Sequence[str], env: Mapping[str, str],
                      kfd_gpus: int | None) -> str | None:
    """Why the engine cannot get the GPUs its arguments ask for on this node, or None."""
    if not kfd_gpus:
        return None
    needed = gpus_needed(engine, engine_args)
    if needed is None:
        return None
    count, first, how = needed
    visible, why = visible_gpus(kfd_gpus, env)
    if count <= visible:
        return None
    ask = f"GPU ids up to {count - 1}" if first else f"{count} GPUs"
    return (f"the engine arguments ask for {ask} on this node ({how}) but it has {visible} ({why}): lower the "
            "parallel sizes, or make more GPUs visible to the engine")
