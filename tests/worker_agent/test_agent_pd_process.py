"""Prefill and decode workers: real agents over the mock engine register the role their engine runs."""

import asyncio
import json
import os
import signal
import time

import aiohttp
import pytest

from infera.procs import free_port
from infera_common.schemas import Role, WorkerStatus

from .agent_proc import AgentProc
from .test_agent_process import bus, eventually  # noqa: F401  (bus: a fixture)

PRODUCER = json.dumps({"kv_connector": "MooncakeConnector", "kv_role": "kv_producer"})
CONSUMER = json.dumps({"kv_connector": "MooncakeConnector", "kv_role": "kv_consumer"})


@pytest.fixture
def pd_agents(nats_server, tmp_path, subprocess_env):
    started: list[AgentProc] = []

    def start(worker_id: str, engine_args: list[str], env: dict[str, str] | None = None,
              agent_args: list[str] | None = None) -> AgentProc:
        a = AgentProc(nats_server, tmp_path, {**subprocess_env, **(env or {})}, worker_id,
                      ["--no-enable-kv-events", *(agent_args or [])],
                      ["--served-model-name", "smol", *engine_args]).start()
        started.append(a)
        return a

    yield start
    for a in started:
        a.cleanup()


async def get(url: str):
    async with aiohttp.ClientSession() as s, s.get(url, timeout=aiohttp.ClientTimeout(total=5)) as resp:
        assert resp.status == 200, url
        return await resp.text()


async def test_sglang_prefill_and_decode_register_their_roles(bus, pd_agents):
    port = free_port()
    pd_agents("w-prefill", ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(port),
                            "--dp-size", "2"])
    pd_agents("w-decode", ["--disaggregation-mode", "decode"])
    prefill, decode = await bus.active("w-prefill"), await bus.active("w-decode")

    assert (prefill.role, prefill.dp_size) == (Role.PREFILL, 2)
    assert prefill.pd.protocol == "sglang-bootstrap"
    assert (prefill.pd.bootstrap_host, prefill.pd.bootstrap_port) == ("127.0.0.1", port)
    assert await get(f"http://127.0.0.1:{port}/health") == "OK"  # the engine's bootstrap server is there
    assert (decode.role, decode.dp_size) == (Role.DECODE, 1)
    assert decode.pd.protocol == "sglang-bootstrap" and decode.pd.bootstrap_port is None

    starting = next(c.record for c in bus.changes if c.record.worker_id == "w-prefill")
    assert (starting.status, starting.role) == (WorkerStatus.STARTING, Role.PREFILL)  # from the flags, at once


async def test_vllm_prefill_registers_the_port_and_engine_id_the_engine_reports(bus, pd_agents):
    # port 0: the mock binds a free port; the agent registers the one the engine reports
    pd_agents("w-vprefill", ["--engine-flavor", "vllm", "--kv-transfer-config", PRODUCER, "--dp-size", "2"],
              env={"VLLM_MOONCAKE_BOOTSTRAP_PORT": "0"})
    pd_agents("w-vdecode", ["--engine-flavor", "vllm", "--kv-transfer-config", CONSUMER])
    prefill, decode = await bus.active("w-vprefill"), await bus.active("w-vdecode")

    assert (prefill.role, prefill.dp_size, prefill.pd.protocol) == (Role.PREFILL, 2, "vllm-mooncake")
    port = prefill.pd.bootstrap_port
    assert port and port > 0
    ranks = json.loads(await get(f"http://127.0.0.1:{port}/query"))
    assert [ranks[r]["engine_id"] for r in ("0", "1")] == [f"{prefill.pd.engine_id}_dp{r}" for r in (0, 1)]
    assert (decode.role, decode.pd.protocol, decode.pd.bootstrap_port) == (Role.DECODE, "vllm-mooncake", None)


async def test_a_wrong_combination_fails_in_seconds_naming_the_fix(bus, pd_agents):
    t0 = time.monotonic()
    agent = pd_agents("w-wrong", ["--engine-flavor", "vllm", "--disaggregation-mode", "prefill"])
    assert await asyncio.to_thread(agent.wait, 20) == 2
    assert time.monotonic() - t0 < 10
    err = agent.err_path.read_text()
    assert "--disaggregation-mode is SGLang's flag" in err and "kv_producer" in err
    assert agent.event("engine_spawned") is None and bus.watcher.view.get("w-wrong") is None


@pytest.mark.parametrize("engine_args", [["--engine-flavor", "vllm", "--kv-transfer-config", CONSUMER],
                                         ["--disaggregation-mode", "decode"]], ids=["vllm", "sglang"])
async def test_a_decode_worker_whose_gpu_hangs_leaves_routing_until_it_answers(bus, pd_agents, engine_args):
    """A vLLM leg gets the stall check (its canary needs no pair); an SGLang leg's /health generates.
    Either way the record says a hang would be found, so requests waiting there are said alive."""
    agent = pd_agents("w-dhang", engine_args, agent_args=[
        "--health-check-interval", "0.3", "--health-check-timeout", "1", "--engine-idle-canary-after", "1",
        "--load-interval", "0.1"])
    record = await bus.active("w-dhang")
    assert record.role == Role.DECODE and record.finds_hangs
    engine_pid = agent.engine_pid()
    os.kill(engine_pid, signal.SIGUSR1)  # the mock's simulated GPU hang, while idle
    try:
        assert await eventually(lambda: bus.watcher.view.get("w-dhang").status == WorkerStatus.UNHEALTHY, 10)
        if "vllm" in engine_args:  # vLLM's /health passes a hung GPU: the agent's canary found it
            async with aiohttp.ClientSession() as s, s.get(f"{record.url}/health") as resp:
                assert resp.status == 200
    finally:
        os.kill(engine_pid, signal.SIGUSR2)
    await bus.active("w-dhang", timeout=10)
