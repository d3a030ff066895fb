"""Whether the ports the engine is to listen on are free on this host, checked before launch.

A port another process holds (an engine still running from an earlier launch, a crashed launch's
leftover) fails the engine only when it binds it: SGLang and vLLM open their HTTP port after
loading the model, minutes into the launch. Meanwhile the agent's health wait would be answered
by whatever holds the port, and could register that as this worker. Checked: the HTTP port, on
the engine's ``--host`` (each engine's default when not given), and an SGLang prefill's bootstrap
port, which it binds on the same host (``--disaggregation-bootstrap-port``, default 8998: two
prefill engines on one node need different ones). A test bind with ``SO_REUSEADDR``, as the
engines' servers bind, so a port left in TIME_WAIT counts as free.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Callable

from infera_common.schemas import Role
from infera_worker_agent.engine_cmd import WILDCARD_HOSTS, EnginePlan

#: where each engine listens without ``--host`` (SGLang's and the mock's default; vLLM: every interface)
DEFAULT_BIND = {"sglang": "127.0.0.1", "vllm": "0.0.0.0", "mock": "127.0.0.1"}


def port_taken(host: str, port: int) -> bool:
    """Whether binding ``host:port`` fails because the port is in use (any other failure: the engine says)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def bind_host(plan: EnginePlan) -> str:
    host = (plan.bind_host or DEFAULT_BIND.get(plan.engine, "0.0.0.0")).strip("[]")
    if host in WILDCARD_HOSTS:
        return "::" if ":" in host else "0.0.0.0"
    return host


def port_problems(plan: EnginePlan, taken: Callable[[str, int], bool] = port_taken) -> list[str]:
    host = bind_host(plan)
    problems = []
    if taken(host, plan.port):
        problems.append(f"the engine's port {plan.port} on {host} is in use (an engine still running there?): stop "
                        "what holds it, or give the engine another --port (or none: the agent then picks a free one)")
    pd = plan.pd
    if (plan.engine == "sglang" and pd is not None and pd.role is Role.PREFILL and pd.bootstrap_port
            and taken(host, pd.bootstrap_port)):
        problems.append(f"the prefill's bootstrap port {pd.bootstrap_port} on {host} is in use (another prefill "
                        "engine on this node?): give this one another --disaggregation-bootstrap-port")
    return problems
