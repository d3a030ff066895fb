"""Fake hosts and a context builder for the recipe-rule tests (the rules are pure: no real host needed)."""

from __future__ import annotations

from infera_worker_agent.engine_cmd import vllm_flag_view
from infera_common.host.rdma import RdmaPort
from infera_worker_agent.host_probe import HostFacts
from infera_worker_agent.pd_role import plan_pd
from infera_worker_agent.recipe_types import RecipeContext

LINK_LOCAL = "fe80:0000:0000:0000:0000:0000:0000:0001"


def roce_port(device: str, ipv4: str | None, *, active: bool = True, port: int = 1, index: int = 1) -> RdmaPort:
    """A RoCE port whose GID ``index`` is the IPv4-mapped GID of ``ipv4`` (GID 0 link-local)."""
    gids = [LINK_LOCAL] + ["0000:0000:0000:0000:0000:0000:0000:0000"] * max(index, 1)
    if ipv4 is not None:
        a, b, c, d = (int(x) for x in ipv4.split("."))
        gids[index] = f"0000:0000:0000:0000:0000:ffff:{a:02x}{b:02x}:{c:02x}{d:02x}"
    return RdmaPort(device, port, active, "Ethernet", tuple(gids))


def rdma_host(*ports: RdmaPort, rocm: bool = True, sglang: str | None = "0.5.19") -> HostFacts:
    return HostFacts(rocm=rocm, rdma_ports=tuple(ports), sglang_version=sglang)


#: A ROCm node with two RoCE NICs, both up; the rail addresses are on 192.168.1.0/24.
GOOD_HOST = rdma_host(roce_port("ionic_0", "192.168.1.11"), roce_port("ionic_1", "192.168.1.21"))
LAPTOP = HostFacts()  # no ROCm, no RDMA, no SGLang


def make_ctx(engine: str, args: list[str], *, env: dict | None = None, host: HostFacts = GOOD_HOST,
             kv_events: bool = True, advertise: str = "10.0.0.11", allow_tcp: bool = False) -> RecipeContext:
    env = {} if env is None else env
    view = vllm_flag_view(args) if engine == "vllm" else list(args)
    return RecipeContext(engine=engine, args=tuple(view), env=env, host=host, kv_events=kv_events,
                         pd=plan_pd(engine, view, env=env), advertise_host=advertise, allow_tcp=allow_tcp)


SGLANG_DECODE = ["--model-path", "/m", "--disaggregation-mode", "decode", "--disaggregation-transfer-backend",
                 "mooncake"]
SGLANG_PREFILL = ["--model-path", "/m", "--disaggregation-mode", "prefill", "--disaggregation-transfer-backend",
                  "mooncake"]
VLLM_PRODUCER = '{"kv_connector":"MooncakeConnector","kv_role":"kv_producer"}'
VLLM_CONSUMER = '{"kv_connector":"MooncakeConnector","kv_role":"kv_consumer"}'
