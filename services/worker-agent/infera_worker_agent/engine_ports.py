"""Whether the ports the engine is to listen on are free on this host, checked before launch.

A port another process holds (an engine still running from an earlier launch, a crashed launch's
leftover) fails the engine only when it binds it: SGLang and vLLM open their HTTP port after
loading the model, minutes into the launch. Meanwhile the agent's health wait would be answered
by whatever holds the port, and could register that as this worker. Checked: the HTTP port, on
the engine's ``--host`` (each engine's default when not given), and an SGLang prefill's bootstrap
port, which it binds on the same host (``--disaggregation-bootstrap-port``, default 8998: two
prefill engines on one node need different ones), and the KV-event publisher and replay ports a
user's ``--kv-events-config`` names for the engine to bind (two engines on one node given the same
config collide; the ports the agent picks itself are free). A test bind as the engines' servers
bind (``ports.bind_failure``). The same bind finds an engine ``--host`` that is not an address of
this host (or does not resolve): that engine could never listen, and would find out as late.
"""

from __future__ import annotations

from collections.abc import Callable

from infera_common.kv_endpoints import is_wildcard, split_tcp
from infera_common.ports import IN_USE, bind_failure
from infera_common.schemas import Role
from infera_worker_agent.engine_cmd import WILDCARD_HOSTS, EnginePlan

#: where each engine listens without ``--host`` (SGLang's and the mock's default; vLLM: every interface)
DEFAULT_BIND = {"sglang": "127.0.0.1", "vllm": "0.0.0.0", "mock": "127.0.0.1"}


def bind_host(plan: EnginePlan) -> str:
    host = (plan.bind_host or DEFAULT_BIND.get(plan.engine, "0.0.0.0")).strip("[]")
    if host in WILDCARD_HOSTS:
        return "::" if ":" in host else "0.0.0.0"
    return host


def port_problems(plan: EnginePlan, bind: Callable[[str, int], str | None] = bind_failure) -> list[str]:
    host = bind_host(plan)
    failure = bind(host, plan.port)
    if failure is not None and failure != IN_USE:  # the engine cannot listen there at all
        return [f"the engine's --host {host} is {failure}: the engine could not listen on it; pass one of this "
                "host's addresses, or 0.0.0.0 for all of them"]
    problems = []
    if failure == IN_USE:
        problems.append(f"the engine's port {plan.port} on {host} is in use (an engine still running there?): stop "
                        "what holds it, or give the engine another --port (or none: the agent then picks a free one)")
    pd = plan.pd
    if (plan.engine == "sglang" and pd is not None and pd.role is Role.PREFILL and pd.bootstrap_port
            and bind(host, pd.bootstrap_port) == IN_USE):
        problems.append(f"the prefill's bootstrap port {pd.bootstrap_port} on {host} is in use (another prefill "
                        "engine on this node?): give this one another --disaggregation-bootstrap-port")
    kv = plan.kv_events
    if kv is not None and kv.enabled and kv.user_supplied:
        for source in kv.sources:
            for endpoint in (source.endpoint, source.replay_endpoint):
                parts = split_tcp(endpoint or "")  # the engine binds tcp://*:P (a concrete host: it connects)
                if parts is None or not is_wildcard(endpoint or "") or parts[1] == 0:
                    continue
                if bind("0.0.0.0", parts[1]) == IN_USE:
                    problems.append(f"the KV-event port {parts[1]} (DP rank {source.dp_rank}: {endpoint}, from "
                                    "--kv-events-config) is in use (another engine on this node given the same "
                                    "config?): give each engine its own ports, or leave --kv-events-config out "
                                    "and let the agent pick free ones")
    return problems
