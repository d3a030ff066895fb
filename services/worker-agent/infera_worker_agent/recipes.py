"""The launch recipe: the rules applied, in order, to the planned engine command line. Pure.

``apply_recipes`` runs each rule on the command line as it stands (the user's arguments, then the
agent's additions, then each earlier rule's), so no flag is ever added twice and the user's own
flags always win. Rules (one module each for cache and RDMA, see their docstrings):

1. ``hicache_decode_rule``: HiCache on an SGLang decode implies the decode radix flag.
2. ``decode_radix_rule``: KV events on + SGLang Mooncake decode: the decode radix flag.
3. ``kv_cache_dtype_rule``: ``--kv-cache-dtype fp8_e4m3`` unless given.
4. ``pd_preflight_rule``: a PD leg needs a routable advertise host and RDMA (else refused).
5. ``rocm_rdma_env_rule``: the ROCm RDMA environment for a PD leg (only unset variables).

KV events (``kv_config``) and the role (``pd_role``) are planned before, by ``plan_engine``.
Only ``--engine sglang|vllm`` get rules 1-5: the mock engine's KV transfer is always a simulated
TCP transfer and it ignores the real engines' cache flags. Every other environment variable
(``HIP_VISIBLE_DEVICES``, ``SGLANG_*``, ``VLLM_*``, ``MC_*``, ...) reaches the engine untouched.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from infera_worker_agent.engine_cmd import EnginePlan, vllm_flag_view
from infera_worker_agent.host_probe import HostFacts
from infera_worker_agent.recipe_cache import decode_radix_rule, hicache_decode_rule, kv_cache_dtype_rule
from infera_worker_agent.recipe_rdma import pd_preflight_rule, rocm_rdma_env_rule
from infera_worker_agent.recipe_types import RecipeContext, RuleResult

Rule = Callable[[RecipeContext], RuleResult]
RULES: tuple[Rule, ...] = (
    hicache_decode_rule,
    decode_radix_rule,
    kv_cache_dtype_rule,
    pd_preflight_rule,
    rocm_rdma_env_rule,
)


def apply_recipes(
    plan: EnginePlan, *, env: Mapping[str, str], host: HostFacts, allow_tcp: bool = False,
    rules: Sequence[Rule] = RULES,
) -> EnginePlan:
    """The plan with the rules' arguments appended, their environment changes and notes recorded.

    Raises ``RecipeRefusal`` (an ``EngineArgsError``) when a rule refuses the launch.
    """
    assert plan.pd is not None and plan.kv_events is not None, "plan_engine plans the role and KV events"
    engine = plan.engine
    added: list[str] = []
    changes: dict[str, str] = {}
    notes: list[str] = list(plan.notes)
    for rule in rules:
        args = list(plan.argv[3:]) + added
        ctx = RecipeContext(
            engine=engine,
            args=tuple(vllm_flag_view(args) if engine == "vllm" else args),
            env={**env, **changes},
            host=host,
            kv_events=plan.kv_events.enabled,
            pd=plan.pd,
            advertise_host=plan.advertise_host,
            allow_tcp=allow_tcp,
        )
        result = rule(ctx)
        added += result.args
        for name, value in result.env:
            changes.setdefault(name, value)
        notes += result.notes
    return replace(plan, argv=(*plan.argv, *added), env_changes=tuple(changes.items()), notes=tuple(notes))


def engine_env(env: Mapping[str, str], plan: EnginePlan) -> dict[str, str]:
    """The engine's environment: the agent's own, plus the recipe's changes (which only fill unset names)."""
    out = dict(env)
    for name, value in plan.env_changes:
        if not out.get(name):
            out[name] = value
    return out


def render_print_command(plan: EnginePlan) -> str:
    """What ``--print-command`` prints: the environment changes, the engine command, the notes."""
    lines = ["# environment changes (only the variables the agent sets; everything else passes through):"]
    if plan.env_changes:
        lines += [f"export {name}={shlex.quote(value)}" for name, value in plan.env_changes]
    else:
        lines.append("#   none")
    lines.append("# engine command:")
    lines += _continued(_argv_lines(plan.argv))
    if plan.notes:
        lines.append("# notes:")
        lines += [f"#   - {n}" for n in plan.notes]
    return "\n".join(lines)


def _argv_lines(argv: Sequence[str]) -> list[str]:
    """``python -m module`` on the first line, then each flag with its values on its own line."""
    lines = [shlex.join(argv[:3])]
    current: list[str] = []
    for arg in argv[3:]:
        if arg.startswith("-") and current:
            lines.append(shlex.join(current))
            current = []
        current.append(arg)
    if current:
        lines.append(shlex.join(current))
    return lines


def _continued(lines: list[str]) -> list[str]:
    return [(line if i == 0 else "  " + line) + (" \\" if i < len(lines) - 1 else "") for i, line in enumerate(lines)]
