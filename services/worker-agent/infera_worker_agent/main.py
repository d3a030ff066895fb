"""``infera-worker-agent --engine mock|sglang|vllm [agent flags] [engine args...]``
(also ``python -m infera.engine.sglang|vllm|mock [agent flags] [engine args...]``)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping

from infera_common.models import default_model_path
from infera_common.ports import free_port, free_port_block
from infera_common.runtime import configure_observability, event_loop_runner
from infera_worker_agent.engine_cmd import EngineArgsError, EnginePlan, launch_problems, plan_engine
from infera_worker_agent.engine_gpus import gpu_count_problem
from infera_worker_agent.engine_install import install_problem
from infera_worker_agent.engine_ports import port_problems
from infera_worker_agent.host_probe import HostFacts, probe_host
from infera_worker_agent.kv_config import index_block_problem
from infera_worker_agent.model_files import path_problems
from infera_worker_agent.planes import plane_problems
from infera_worker_agent.recipes import apply_recipes, render_print_command
from infera_worker_agent.settings import PROG, AgentSettings, parse_agent_cli


def build_plan(
    settings: AgentSettings,
    engine_args: list[str],
    host: HostFacts,
    *,
    env: Mapping[str, str] | None = None,
    python: str | None = None,
    port: int | None = None,
    find_ports: Callable[[int], int] = free_port_block,
) -> EnginePlan:
    """The engine command line, its environment changes and notes; raises EngineArgsError.

    ``env`` (default ``os.environ``), ``python`` (default ``--engine-python``, else this interpreter),
    ``port`` (default a free one) and ``find_ports`` are injectable so a test can render a fixed
    ``--print-command``.
    """
    env = os.environ if env is None else env
    plan = plan_engine(
        settings.engine,
        engine_args,
        python=python or settings.engine_python or sys.executable,
        free_port=free_port() if port is None else port,
        default_model_path=str(default_model_path()),
        advertise_host=settings.advertise_host,
        enable_kv_events=settings.enable_kv_events,
        find_ports=find_ports,
        role=settings.role,
        env=env,
        present_modules=host.launch_modules,
    )
    return apply_recipes(plan, env=env, host=host, allow_tcp=settings.disaggregation_allow_tcp)


def refusals(settings: AgentSettings, plan: EnginePlan, host: HostFacts, env: Mapping[str, str]) -> list[str]:
    """Why this launch cannot work, each naming what to change; the engine is not started when any."""
    kv_sources = plan.kv_events.sources if plan.kv_events is not None and plan.kv_events.enabled else ()
    problems: list[str | None] = [*plane_problems(settings, plan.advertise_host, kv_sources)]
    problems += launch_problems(settings.engine, plan.engine_args, env)
    problems += path_problems(settings.engine, plan.engine_args)
    problems += port_problems(plan)
    problems.append(gpu_count_problem(settings.engine, plan.engine_args, env, host.gpus))
    if settings.enable_kv_events:
        problems.append(index_block_problem(settings.engine, settings.kv_index_block_size, plan.engine_args))
    problems.append(install_problem(settings.engine, plan.argv[0], host, named=settings.engine_python is not None))
    return [p for p in problems if p is not None]


def main(argv: list[str] | None = None) -> int:
    settings, engine_args = parse_agent_cli(list(sys.argv[1:] if argv is None else argv))
    # the mock gets no recipe rules: no host facts needed (and no SGLang import metadata scan), unless it
    # runs under another interpreter, which is then asked whether it has the mock
    mock_here = settings.engine == "mock" and settings.engine_python is None
    host = HostFacts() if mock_here else probe_host(os.environ, python=settings.engine_python)
    try:
        plan = build_plan(settings, engine_args, host)
    except EngineArgsError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        # what needs no plan is said too: one round of fixes instead of one per refusal
        missing = install_problem(settings.engine, settings.engine_python or sys.executable, host,
                                  named=settings.engine_python is not None)
        if missing is not None:
            print(f"{PROG}: error: {missing}", file=sys.stderr)
        return 2
    problems = refusals(settings, plan, host, os.environ)
    if settings.print_command:
        print(render_print_command(plan))
        for problem in problems:
            print(f"{PROG}: note: launching would be refused: {problem}", file=sys.stderr)
        return 0
    if problems:
        for problem in problems:
            print(f"{PROG}: error: {problem}", file=sys.stderr)
        return 2
    configure_observability(settings, "worker-agent", worker_id=settings.worker_id)
    from infera_worker_agent.service import Agent  # not needed to print the command

    with event_loop_runner() as runner:
        return runner.run(Agent(settings, plan).run())


if __name__ == "__main__":
    sys.exit(main())
