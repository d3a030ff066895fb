"""docs/recipes.md shows `--print-command` for the DeepSeek-V4-Pro 1P1D legs: it must be exactly what
the agent prints for those command lines on the ROCm nodes described there (ports fixed, `python3`
for the interpreter path)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from infera_worker_agent.main import build_plan
from infera_worker_agent.recipes import render_print_command
from infera_worker_agent.settings import parse_agent_cli
from tests.worker_agent.recipe_fakes import rdma_host, roce_port

DOC = Path(__file__).resolve().parents[2] / "docs" / "recipes.md"
IB = ",".join(f"ionic_{i}" for i in range(8))
COMMON = ["--model-path", "deepseek-ai/DeepSeek-V4-Pro", "--served-model-name", "DeepSeek-V4-Pro",
          "--trust-remote-code", "--host", "0.0.0.0", "--port", "30000", "--tp", "8", "--dp", "8",
          "--enable-dp-attention", "--disaggregation-transfer-backend", "mooncake", "--disaggregation-ib-device", IB,
          "--mem-fraction-static", "0.85"]
LEGS = {
    # leg: (entry-point arguments, the node's RDMA rail address on ionic_0)
    "prefill": (["--advertise-host", "10.0.0.11", *COMMON, "--disaggregation-mode", "prefill",
                 "--disaggregation-bootstrap-port", "8998"], "192.168.1.11"),
    "decode": (["--advertise-host", "10.0.0.12", "--no-enable-kv-events", *COMMON, "--disaggregation-mode",
                "decode"], "192.168.1.12"),
}


def node(rail: str):
    """An MI355X node: ROCm, eight RoCE NICs up (ionic_0 carries ``rail``), SGLang 0.5.19."""
    last = int(rail.rsplit(".", 1)[1])
    return rdma_host(*(roce_port(f"ionic_{i}", f"192.168.{1 + i}.{last}") for i in range(8)), sglang="0.5.19")


def render(leg: str) -> str:
    args, rail = LEGS[leg]
    settings, engine_args = parse_agent_cli(["--engine", "sglang", *args])
    blocks = iter((20000, 20100))
    plan = build_plan(settings, engine_args, node(rail), env={"HIP_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"},
                      python="python3", port=30000, find_ports=lambda n: next(blocks))
    return render_print_command(plan)


def command_line(leg: str) -> str:
    return "python -m infera.engine.sglang " + shlex.join(LEGS[leg][0]) + " --print-command"


@pytest.mark.parametrize("leg", sorted(LEGS))
def test_recipes_doc_shows_what_print_command_prints_for_each_deepseek_leg(leg):
    text = DOC.read_text()
    assert render(leg) in text, f"docs/recipes.md is stale for the {leg} leg; regenerate it:\n{render(leg)}"
    flat = " ".join(text.replace("\\\n", " ").split())
    assert " ".join(command_line(leg).split()) in flat, f"the {leg} command line in docs/recipes.md changed"
