"""Proof against SGLang's own argument parser (issue 5): the command lines the worker-agent builds for
the runbooks' SGLang launches parse with ``sglang.srt.server_args.prepare_server_args``, pass SGLang's
model-independent validators of the flags the agent writes, and differ from the user's own command
line exactly by the recipe's rewrites.

Each launch is built the way ``--print-command`` builds it (``main.build_plan`` on an MI355X node:
ROCm, eight RoCE NICs up, the installed SGLang's version) and parsed twice: the user's arguments
alone, and the agent's full command line. The fields that differ are the rewrites (``enable_metrics``,
``kv_events_config``, ``kv_cache_dtype``, ``disaggregation_decode_enable_radix_cache``): every other
field, the user's flags included, parses the same. Then SGLang's PD hook resolves the decode's cache
(radix or chunk) and refuses what it refuses; with speculative decoding the decode radix cache needs
the patch ``docker/Dockerfile.sglang`` applies (stock SGLang refuses it, and the test shows that too).

Skipped when SGLang is not installed: ``make test-slow`` (or ``make sglang-parser``) installs it in
its own venv, ``.venv-sglang`` (``--no-deps`` plus the ``slow-sglang`` extra, ~2 minutes once), and
runs this file with ``.venv-sglang/bin/pytest``. Runs in ~10-20 s, most of it
importing SGLang.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from infera_worker_agent.engine_cmd import EnginePlan
from infera_worker_agent.engine_gpus import gpus_needed
from infera_worker_agent.main import build_plan
from infera_worker_agent.recipe_types import RecipeRefusal
from infera_worker_agent.recipes import engine_env
from infera_worker_agent.settings import parse_agent_cli
from tests.slow import sglang_parser
from tests.worker_agent.recipe_fakes import rdma_host, roce_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
NOT_INSTALLED = ("SGLang is not installed in this interpreter: `make sglang-parser` installs it in .venv-sglang "
                 "(pip install --no-deps sglang==SGLANG_VERSION, plus the slow-sglang extra), and `make test-slow` "
                 "runs this file with .venv-sglang/bin/pytest")

DOC = Path(__file__).resolve().parents[2] / "docs" / "recipes.md"
IB = ",".join(f"ionic_{i}" for i in range(8))
KV_PORTS = (20000, 20100)  # first ports of the publisher and replay blocks the agent reserves
OPT_IN = {"SGLANG_EXPERIMENTAL_DECODE_RADIX_SPEC": "1"}  # read by the patched image's PD hook
METRICS, DTYPE, RADIX = (
    {"enable_metrics": True}, {"kv_cache_dtype": "fp8_e4m3"}, {"disaggregation_decode_enable_radix_cache": True})
KV_EVENTS = {"kv_events_config": "<the agent's --kv-events-config>"}

DEEPSEEK = ["--model-path", "deepseek-ai/DeepSeek-V4-Pro", "--served-model-name", "DeepSeek-V4-Pro",
            "--trust-remote-code", "--host", "0.0.0.0", "--port", "30000", "--tp", "8", "--dp", "8",
            "--enable-dp-attention", "--disaggregation-transfer-backend", "mooncake",
            "--disaggregation-ib-device", IB, "--mem-fraction-static", "0.85"]
GLM = ["--model-path", "zai-org/GLM-4.6-FP8", "--served-model-name", "GLM-4.6-FP8", "--host", "0.0.0.0",
       "--port", "30000", "--tp", "8", "--tool-call-parser", "glm45", "--reasoning-parser", "glm45",
       "--disaggregation-transfer-backend", "mooncake", "--disaggregation-ib-device", IB,
       "--mem-fraction-static", "0.85"]


def mtp(algorithm: str = "EAGLE") -> list[str]:
    """GLM-4.x MTP as SGLang's GLM page launches it (NEXTN is SGLang's other name for it)."""
    return ["--speculative-algorithm", algorithm, "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
            "--speculative-num-draft-tokens", "4"]


@dataclass(frozen=True)
class Launch:
    args: tuple[str, ...]  # the entry point's arguments: Infera's flags and the engine's
    rewrites: dict  # ServerArgs fields the agent's additions change (user's command line -> agent's)
    decode_cache: str | None = None  # what SGLang's PD hook resolves on a decode: "radix" | "chunk"
    env: dict = field(default_factory=dict)  # the operator's environment for this launch
    rail: str = "192.168.1.12"  # the node's RDMA rail address on ionic_0
    patched_only: bool = False  # decode radix + speculative decoding: stock SGLang refuses it


LAUNCHES = {
    # docs/recipes.md, DeepSeek-V4-Pro 1P1D
    "deepseek-v4-pro-prefill": Launch(
        ("--advertise-host", "10.0.0.11", *DEEPSEEK, "--disaggregation-mode", "prefill",
         "--disaggregation-bootstrap-port", "8998"), METRICS | KV_EVENTS | DTYPE, rail="192.168.1.11"),
    "deepseek-v4-pro-decode": Launch(
        ("--advertise-host", "10.0.0.12", "--no-enable-kv-events", *DEEPSEEK, "--disaggregation-mode", "decode"),
        METRICS | DTYPE, "chunk"),
    # docs/recipes.md, GLM-4.6 1P1D with MTP: the prefill (it sends the draft's hidden states, so it
    # runs MTP too), the decode with HiCache (the runbook) and without
    "glm-4.6-prefill-mtp": Launch(
        ("--advertise-host", "10.0.0.11", *GLM, *mtp(), "--disaggregation-mode", "prefill",
         "--disaggregation-bootstrap-port", "8998"), METRICS | KV_EVENTS | DTYPE, rail="192.168.1.11"),
    "glm-4.6-decode-mtp-hicache": Launch(
        ("--advertise-host", "10.0.0.12", *GLM, *mtp(), "--disaggregation-mode", "decode",
         "--enable-hierarchical-cache"), METRICS | KV_EVENTS | DTYPE | RADIX, "radix", OPT_IN, patched_only=True),
    "glm-4.6-decode-mtp": Launch(
        ("--advertise-host", "10.0.0.12", *GLM, *mtp(), "--disaggregation-mode", "decode"),
        METRICS | KV_EVENTS | DTYPE | RADIX, "radix", OPT_IN, patched_only=True),
    # the same decode without the opt-in: speculative decode keeps SGLang's chunk cache
    "glm-4.6-decode-mtp-stock": Launch(
        ("--advertise-host", "10.0.0.12", *GLM, *mtp(), "--disaggregation-mode", "decode"),
        METRICS | KV_EVENTS | DTYPE, "chunk"),
    # NEXTN, HiCache, KV events off: HiCache alone implies the radix flag; KV events stay off
    "glm-4.6-decode-nextn-hicache-no-kv-events": Launch(
        ("--advertise-host", "10.0.0.12", "--no-enable-kv-events", *GLM, *mtp("NEXTN"), "--disaggregation-mode",
         "decode", "--enable-hierarchical-cache"), METRICS | DTYPE | RADIX, "radix", OPT_IN, patched_only=True),
    # no speculative decoding: stock SGLang takes the decode radix cache the KV-events rule appends
    "glm-4.6-decode": Launch(
        ("--advertise-host", "10.0.0.12", *GLM, "--disaggregation-mode", "decode"),
        METRICS | KV_EVENTS | DTYPE | RADIX, "radix"),
    "glm-4.6-decode-hicache": Launch(
        ("--advertise-host", "10.0.0.12", *GLM, "--disaggregation-mode", "decode", "--enable-hierarchical-cache"),
        METRICS | KV_EVENTS | DTYPE | RADIX, "radix"),
}


# --- SGLang, loaded once; the process's environment and logging put back afterwards ---------------
@pytest.fixture(scope="module")
def sglang():
    if not sglang_parser.installed():
        pytest.skip(NOT_INSTALLED)
    saved_env, root = dict(os.environ), logging.getLogger()
    saved_log = (root.level, list(root.handlers))
    try:
        yield sglang_parser.load()
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        root.handlers[:] = saved_log[1]
        root.setLevel(saved_log[0])


@pytest.fixture
def engine_environ():
    """Sets the engine's environment (SGLang's hooks read it from os.environ); restores it after."""
    saved = dict(os.environ)
    root = logging.getLogger()
    saved_log = (root.level, list(root.handlers))  # prepare_server_args calls logging.basicConfig(force=True)

    def apply(env: dict[str, str]) -> None:
        for name in ("SGLANG_EXPERIMENTAL_DECODE_RADIX_SPEC", "MC_FORCE_TCP"):
            os.environ.pop(name, None)
        os.environ.update(env)

    yield apply
    os.environ.clear()
    os.environ.update(saved)
    root.handlers[:] = saved_log[1]
    root.setLevel(saved_log[0])


def node(rail: str, sglang_version: str):
    """An MI355X node: ROCm, eight RoCE NICs up (ionic_0 carries ``rail``), this SGLang installed."""
    last = int(rail.rsplit(".", 1)[1])
    return rdma_host(*(roce_port(f"ionic_{i}", f"192.168.{1 + i}.{last}") for i in range(8)), sglang=sglang_version)


def plan_for(launch: Launch, version: str, requests: list[int] | None = None) -> tuple[EnginePlan, dict]:
    """The agent's plan for ``launch`` and the engine's environment (``requests``: the block sizes
    the agent asked its port finder for)."""
    settings, engine_args = parse_agent_cli(["--engine", "sglang", *launch.args])
    blocks = iter(KV_PORTS)

    def find_ports(n: int) -> int:
        if requests is not None:
            requests.append(n)
        return next(blocks)

    env = {"HIP_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7", **launch.env}
    plan = build_plan(settings, engine_args, node(launch.rail, version), env=env, python="python3",
                      port=30000, find_ports=find_ports)
    return plan, engine_env(env, plan)


def changed_fields(before, after) -> dict:
    return {f.name: getattr(after, f.name) for f in dataclasses.fields(after)
            if getattr(after, f.name) != getattr(before, f.name)}


# --- the tests ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(LAUNCHES))
def test_agent_command_line_parses_with_sglang_and_differs_from_the_users_only_by_the_rewrites(
        name, sglang, engine_environ):
    launch = LAUNCHES[name]
    plan, env = plan_for(launch, sglang.version)
    engine_environ(env)
    user = sglang.parse(list(plan.engine_args))
    agent = sglang.parse(list(plan.argv[3:]))  # exactly what `python3 -m sglang.launch_server` gets

    expected = dict(launch.rewrites)
    if "kv_events_config" in expected:
        expected["kv_events_config"] = agent.kv_events_config
        assert agent.kv_events_config and agent.kv_events_config.startswith("{")
    assert changed_fields(user, agent) == expected, f"SGLang {sglang.version}: {shlex.join(plan.argv)}"
    assert agent.kv_cache_dtype == "fp8_e4m3" and agent.enable_metrics
    assert (agent.disaggregation_mode, agent.disaggregation_transfer_backend) == (
        plan.pd.role.value, "mooncake")
    assert agent.disaggregation_decode_enable_radix_cache is ("disaggregation_decode_enable_radix_cache" in expected)
    assert (agent.kv_events_config is not None) is ("--no-enable-kv-events" not in launch.args)
    # the user's own flags, as SGLang reads them
    assert (agent.port, agent.host, agent.tp_size, agent.mem_fraction_static) == (30000, "0.0.0.0", 8, 0.85)
    assert agent.disaggregation_ib_device == IB
    assert agent.enable_hierarchical_cache is ("--enable-hierarchical-cache" in launch.args)


@pytest.mark.parametrize("name", sorted(n for n, launch in LAUNCHES.items() if "kv_events_config" in launch.rewrites))
def test_kv_events_config_is_sglangs_schema_and_every_dp_rank_publishes_where_the_agent_listens(
        name, sglang, engine_environ):
    launch = LAUNCHES[name]
    requests: list[int] = []
    plan, env = plan_for(launch, sglang.version, requests)
    engine_environ(env)
    agent = sglang.parse(list(plan.argv[3:]))
    config = sglang.kv_events_config(agent.kv_events_config)
    assert (config.publisher, config.topic) == ("zmq", "")
    assert (config.endpoint, config.replay_endpoint) == tuple(f"tcp://*:{p}" for p in KV_PORTS)
    assert requests == [agent.dp_size, agent.dp_size], "one block of dp_size ports for publishers, one for replay"
    # SGLang offsets each DP rank's sockets by its rank: the agent subscribes to exactly those
    published = [(sglang.offset_endpoint_port(config.endpoint, r), sglang.offset_endpoint_port(config.replay_endpoint, r))
                 for r in range(agent.dp_size)]
    assert published == [(s.endpoint, s.replay_endpoint) for s in plan.kv_events.sources]


@pytest.mark.parametrize("name", sorted(n for n, launch in LAUNCHES.items() if launch.decode_cache))
def test_sglangs_pd_hook_gives_the_decode_the_cache_the_agent_planned(name, sglang, engine_environ):
    launch = LAUNCHES[name]
    plan, env = plan_for(launch, sglang.version)
    engine_environ(env)
    if launch.patched_only:
        stock = sglang.parse(list(plan.argv[3:]))
        with pytest.raises(ValueError, match="incompatible with speculative decoding"):
            sglang.handle_pd_disaggregation(stock)
        validate = sglang.patched_handle_pd_disaggregation  # what docker/Dockerfile.sglang ships
    else:
        validate = sglang.handle_pd_disaggregation
    agent = sglang.parse(list(plan.argv[3:]))
    validate(agent)
    view = sglang.resolving_view(agent)
    assert view.disable_radix_cache is (launch.decode_cache == "chunk")
    if agent.enable_hierarchical_cache:
        # the scheduler's enable_decode_hicache: radix flag and HiCache together
        assert view.disaggregation_decode_enable_radix_cache and view.enable_hierarchical_cache
        sglang.handle_hicache(agent)


def test_patched_hook_still_refuses_decode_radix_with_mtp_without_the_opt_in(sglang, engine_environ):
    """The patch narrows SGLang's refusal to the opt-in only: the agent must not append the flag
    without it, and it does not."""
    launch = LAUNCHES["glm-4.6-decode-mtp-stock"]
    plan, env = plan_for(launch, sglang.version)
    engine_environ(env)
    assert "--disaggregation-decode-enable-radix-cache" not in plan.argv
    forced = sglang.parse([*plan.argv[3:], "--disaggregation-decode-enable-radix-cache"])
    with pytest.raises(ValueError, match="incompatible with speculative decoding"):
        sglang.patched_handle_pd_disaggregation(forced)


def test_hicache_with_mtp_outside_the_opt_in_is_refused_by_the_agent_as_sglang_would(sglang, engine_environ):
    """Decode HiCache needs the radix flag; with MTP and no opt-in SGLang refuses that flag, so the
    agent refuses before launch instead of letting the decode run without HiCache."""
    args = ("--advertise-host", "10.0.0.12", *GLM, *mtp(), "--disaggregation-mode", "decode",
            "--enable-hierarchical-cache")
    with pytest.raises(RecipeRefusal, match="SGLANG_EXPERIMENTAL_DECODE_RADIX_SPEC=1 is not set"):
        plan_for(Launch(args, {}), sglang.version)
    engine_environ({})
    user = sglang.parse([*args[2:], "--disaggregation-decode-enable-radix-cache"])
    with pytest.raises(ValueError, match="incompatible with speculative decoding"):
        sglang.patched_handle_pd_disaggregation(user)


_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def runbook_launches(text: str) -> list[tuple[dict, tuple[str, ...]]]:
    """Every ```bash block of the page that runs ``python -m infera.engine.sglang``: its leading
    ``NAME=value`` words (the environment) and its arguments, without ``--print-command``."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        words = shlex.split(block.replace("\\\n", " "), comments=True)
        env = {}
        while words and _ASSIGNMENT.match(words[0]):
            name, _, value = words.pop(0).partition("=")
            env[name] = value
        if words[:3] == ["python", "-m", "infera.engine.sglang"]:
            out.append((env, tuple(w for w in words[3:] if w != "--print-command")))
    return out


def test_every_sglang_launch_in_the_runbooks_is_proven_here():
    launches = runbook_launches(DOC.read_text())
    assert len(launches) >= 3, "docs/recipes.md shows the DeepSeek-V4-Pro legs and the GLM decode with MTP"
    proven = [(launch.env, launch.args) for launch in LAUNCHES.values()]
    missing = [shlex.join(args) for env, args in launches if (env, args) not in proven]
    assert not missing, f"docs/recipes.md launches not in LAUNCHES (add them with their rewrites): {missing}"


GPU_LAUNCHES = [
    ["--tp", "8"],
    ["--tp-size", "4", "--dp", "2"],
    ["--tensor-parallel-size", "4", "--pipeline-parallel-size", "2"],
    ["--tp", "16", "--nnodes", "2", "--node-rank", "1"],
    ["--tp", "2", "--base-gpu-id", "4", "--gpu-id-step", "2"],
]


@pytest.mark.parametrize("launch", [*GPU_LAUNCHES, *(list(launch.args) for launch in LAUNCHES.values())],
                         ids=shlex.join)
def test_the_gpus_the_agent_counts_are_the_ones_sglang_parses(launch, sglang):
    """The worker-agent refuses a launch that asks for more GPUs than the node shows (``engine_gpus``):
    its reading of the parallel flags must be SGLang's (``--tp`` is argparse's abbreviation)."""
    _, args = parse_agent_cli(["--engine", "sglang", *launch])  # the engine's arguments
    a = sglang.parse(["--model-path", "/m", *args])
    per_node = -(-a.tp_size * a.pp_size // a.nnodes)
    assert gpus_needed("sglang", args)[:2] == (a.base_gpu_id + (per_node - 1) * a.gpu_id_step + 1, a.base_gpu_id)


def test_no_sglang_flag_is_taken_for_a_mistyped_agent_flag(sglang):
    """The agent refuses an engine argument that looks like a mistyped agent flag (``infera_common.typos``):
    none of SGLang's own flags may look so."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    from infera_common.typos import near_misses
    from infera_worker_agent.settings import agent_flags

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    own = agent_flags()
    flags = [o for a in parser._actions for o in a.option_strings if o.startswith("--") and o not in own]
    assert len(flags) > 300 and near_misses(flags, own) == []
