"""Engine entry points: ``python -m infera.engine.sglang|vllm|mock [agent flags] [engine args...]``.

Each is ``infera-worker-agent --engine <engine>``: the worker-agent's own flags (discovery and
transport planes, ``--etcd-endpoint``, ``--advertise-host``, ``--[no-]enable-kv-events``,
``--disaggregation-allow-tcp``, ``--drain-timeout``, ``--print-command``, ...; ``--help`` lists
them) are parsed, every other argument goes to the engine verbatim and in order. Every plane mix
works, the runbooks' no-broker one (``--discovery-backend etcd --request-transport http
--kv-event-transport zmq``) with no NATS server at all.
"""

from __future__ import annotations

import os
import sys

from infera_common.settings import ENV_PREFIX
from infera_worker_agent.main import main as agent_main
from infera_worker_agent.settings import split_engine_tail

ENGINES = ("sglang", "vllm", "mock")
ENGINE_ENV = f"{ENV_PREFIX}ENGINE"  # the agent's --engine setting, read from the environment


def run(engine: str, argv: list[str] | None = None) -> int:
    """Run the worker-agent for ``engine``; a contradicting ``--engine`` is refused (exit 2)."""
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}")
    args = list(sys.argv[1:] if argv is None else argv)
    own, _ = split_engine_tail(args)
    for i, arg in enumerate(own):
        given = own[i + 1] if arg == "--engine" and i + 1 < len(own) else (
            arg.split("=", 1)[1] if arg.startswith("--engine=") else None)
        if given is not None and given != engine:
            print(f"infera.engine.{engine}: error: --engine {given} contradicts the entry point; use "
                  f"python -m infera.engine.{given} (or drop --engine)", file=sys.stderr)
            return 2
    env_engine = os.environ.get(ENGINE_ENV, "").strip()
    if env_engine and env_engine.lower() != engine:  # the flag below would win over it without a word
        print(f"infera.engine.{engine}: error: {ENGINE_ENV}={env_engine} contradicts the entry point; use "
              f"python -m infera.engine.{env_engine.lower()} (or unset {ENGINE_ENV})", file=sys.stderr)
        return 2
    return agent_main(["--engine", engine, *args])
