"""An engine asked for more GPUs than the node shows it is refused before its cold start."""

import pytest

from infera_worker_agent.engine_gpus import gpu_count_problem, gpus_needed, visible_gpus

DP_ATTENTION = ["--tp", "8", "--dp", "8", "--enable-dp-attention"]


@pytest.mark.parametrize("engine,args,count", [
    ("sglang", [], 1),
    ("sglang", ["--tp", "8"], 8),
    ("sglang", ["--tp-size", "4", "--dp-size", "2"], 4),  # DP ranks may share the TP group (DP attention)
    ("sglang", DP_ATTENTION, 8),
    ("sglang", ["--tensor-parallel-size", "8"], 8),
    ("sglang", ["--tp", "16", "--nnodes", "2", "--node-rank", "0"], 8),
    ("sglang", ["--tp", "2", "--pp-size", "2"], 4),
    ("vllm", ["-tp", "8"], 8),
    ("vllm", ["--tensor_parallel_size", "4", "--data-parallel-size", "2"], 8),  # vLLM reads _ as -
    ("vllm", ["--data-parallel-size", "16", "--data-parallel-size-local", "8"], 8),
    ("vllm", ["--data-parallel-size", "8", "--data-parallel-rank", "3", "-tp", "2"], 2),  # one rank a process
    ("vllm", ["-tp", "2", "-pcp", "2", "-pp", "2"], 8),
])
def test_gpus_the_engine_arguments_ask_of_this_node(engine, args, count):
    assert gpus_needed(engine, args)[0] == count


@pytest.mark.parametrize("engine,args", [
    ("vllm", ["-tp", "16", "--nnodes", "2"]),
    ("vllm", ["-tp", "8", "--distributed-executor-backend", "ray"]),
    ("vllm", ["-tp", "2", "--device-ids", "2,3"]),
    ("vllm", ["-tp", "eight"]),  # the engine's parser says what is wrong with it
    ("mock", ["--tp", "64"]),
])
def test_what_one_node_holds_is_not_read_from_these(engine, args):
    assert gpus_needed(engine, args) is None
    assert gpu_count_problem(engine, args, {}, kfd_gpus=1) is None


def test_a_runbooks_tp_8_on_a_node_showing_four_gpus_is_refused_naming_both():
    problem = gpu_count_problem("sglang", ["--model-path", "/m", "--tp", "8"], {"HIP_VISIBLE_DEVICES": "0,1,2,3"}, 8)
    assert problem.startswith("the engine arguments ask for 8 GPUs on this node (--tp-size 8) but it has 4 "
                              "(HIP_VISIBLE_DEVICES=0,1,2,3; 8 in the KFD topology)")
    assert gpu_count_problem("sglang", DP_ATTENTION, {}, 8) is None
    assert gpu_count_problem("sglang", ["--tp", "4", "--dp", "2"], {}, 4) is None  # never refused on DP alone
    assert "(--tp-size 4 × --pp-size 2)" in gpu_count_problem("sglang", ["--tp", "4", "--pp-size", "2"], {}, 7)
    problem = gpu_count_problem("vllm", ["-tp", "8"], {}, 7)
    assert "(--tensor-parallel-size 8) but it has 7 (7 in the KFD topology)" in problem


def test_gpus_counted_from_a_base_id():
    assert gpu_count_problem("sglang", ["--tp", "4", "--base-gpu-id", "4"], {}, 8) is None
    problem = gpu_count_problem("sglang", ["--tp", "4", "--base-gpu-id", "6"], {}, 8)
    assert "ask for GPU ids up to 9 on this node (--tp-size 4, GPU ids 6..9) but it has 8" in problem


def test_no_kfd_topology_nothing_checked():
    assert gpu_count_problem("sglang", ["--tp", "8"], {}, None) is None
    assert gpu_count_problem("sglang", ["--tp", "8"], {}, 0) is None


def test_the_shortest_visible_devices_list_counts():
    assert visible_gpus(8, {"ROCR_VISIBLE_DEVICES": "0,1,2,3", "HIP_VISIBLE_DEVICES": "0,1"}) == (
        2, "HIP_VISIBLE_DEVICES=0,1; 8 in the KFD topology")
    assert visible_gpus(8, {"CUDA_VISIBLE_DEVICES": ""}) == (8, "8 in the KFD topology")  # empty: not set


def test_the_agent_counts_the_kfd_gpus_and_refuses_before_launch(tmp_path, monkeypatch, capsys):
    from infera_common.models import default_model_path
    from infera_worker_agent import main as agent_main
    from infera_worker_agent.host_probe import HostFacts, probe_host
    from tests.tools.fake_node import fake_node

    assert probe_host({}, root=fake_node(tmp_path / "node", gpus=6), version_of=lambda _: None).gpus == 6
    assert probe_host({}, root=fake_node(tmp_path / "no-kfd", kfd=False), version_of=lambda _: None).gpus is None
    monkeypatch.setattr(agent_main, "probe_host", lambda *a, **k: HostFacts(rocm=True, gpus=6))
    argv = ["--engine", "vllm", "--", "--model", str(default_model_path()), "-tp", "8"]
    assert agent_main.main(argv) == 2
    assert "ask for 8 GPUs on this node (--tensor-parallel-size 8) but it has 6" in capsys.readouterr().err
    assert agent_main.main(["--print-command", *argv]) == 0  # shown, with the note
    assert "launching would be refused: the engine arguments ask for 8 GPUs" in capsys.readouterr().err
