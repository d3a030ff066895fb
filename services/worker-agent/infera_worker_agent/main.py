"""``infera-worker-agent --engine mock|sglang|vllm [agent flags] [engine args...]``."""

from __future__ import annotations

import os
import sys

from infera_common.logs import configure_logging
from infera_common.models import default_model_path
from infera_common.runtime import event_loop_runner, free_port
from infera_worker_agent.engine_cmd import EngineArgsError, plan_engine
from infera_worker_agent.ports import free_port_block
from infera_worker_agent.service import Agent
from infera_worker_agent.settings import PROG, parse_agent_cli


def main(argv: list[str] | None = None) -> int:
    settings, engine_args = parse_agent_cli(list(sys.argv[1:] if argv is None else argv))
    try:
        settings.require_supported()
        plan = plan_engine(
            settings.engine,
            engine_args,
            python=sys.executable,
            free_port=free_port(),
            default_model_path=str(default_model_path()),
            advertise_host=settings.advertise_host,
            enable_kv_events=settings.enable_kv_events,
            find_ports=free_port_block,
            role=settings.role,
            env=os.environ,
        )
    except EngineArgsError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level, settings.log_format, service="worker-agent")
    with event_loop_runner() as runner:
        return runner.run(Agent(settings, plan).run())


if __name__ == "__main__":
    sys.exit(main())
