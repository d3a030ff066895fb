"""Command line: SGLang- and vLLM-style flags, defaults, ignored real-engine flags, clear exit-2 errors."""

import shutil

import pytest

from infera_mock_engine.main import parse_args


def test_sglang_style_defaults(model_dir):
    cfg, level = parse_args(["--model-path", str(model_dir)])
    assert cfg.engine_flavor == "sglang" and cfg.port == 30000 and cfg.host == "127.0.0.1"
    assert cfg.served_model_name == str(model_dir)  # the path as given, like SGLang
    assert (cfg.page_size, cfg.num_kv_blocks, cfg.max_running_requests, cfg.max_num_batched_tokens) == (
        64, 16384, 256, 8192)
    assert cfg.context_length == 8192  # config.json max_position_embeddings
    assert cfg.speedup == 1.0 and cfg.startup_delay == 0.0 and cfg.ignored_args == ()
    assert not cfg.disable_overlap_schedule  # SGLang's default: the overlap schedule
    assert level == "info"


def test_vllm_style_flags(model_dir):
    cfg, _ = parse_args(["serve", str(model_dir), "--engine-flavor", "vllm", "--block-size", "32",
                         "--max-model-len", "4096", "--max-num-seqs", "16", "--max-num-batched-tokens", "2048",
                         "--served-model-name", "smol", "alias"])
    assert cfg.model_path == str(model_dir) and cfg.port == 8000
    assert (cfg.page_size, cfg.context_length, cfg.max_running_requests, cfg.max_num_batched_tokens) == (
        32, 4096, 16, 2048)
    assert cfg.served_model_names == ("smol", "alias")
    cfg, _ = parse_args(["--model", str(model_dir), "--chunked-prefill-size", "512", "--page-size", "16",
                         "--max-total-tokens", "1600", "--speedup", "2.5", "--startup-delay", "3"])
    assert (cfg.max_num_batched_tokens, cfg.page_size, cfg.num_kv_blocks, cfg.speedup, cfg.startup_delay) == (
        512, 16, 100, 2.5, 3.0)


def test_unknown_real_engine_flags_are_collected(model_dir):
    cfg, _ = parse_args(["--model-path", str(model_dir), "--tp", "8", "--trust-remote-code",
                         "--mem-fraction-static", "0.8", "--enable-metrics", "--num-kv-blocks", "10"])
    assert cfg.ignored_args == ("--tp", "8", "--trust-remote-code", "--mem-fraction-static", "0.8")
    assert cfg.enable_metrics and cfg.num_kv_blocks == 10
    cfg, _ = parse_args(["--model-path", str(model_dir), "--tp", "8", "--disable-overlap-schedule"])
    assert cfg.disable_overlap_schedule and cfg.ignored_args == ("--tp", "8")  # simulated, not ignored


def _exit2(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_missing_model_exits_2(capsys):
    err = _exit2(capsys, ["--port", "1234"])
    assert "--model-path" in err and "no model" in err


def test_model_dir_without_tokenizer_json_exits_2_naming_it(capsys, tmp_path, model_dir):
    shutil.copy(model_dir / "config.json", tmp_path / "config.json")
    err = _exit2(capsys, ["--model-path", str(tmp_path)])
    assert str(tmp_path / "tokenizer.json") in err


def test_model_that_is_not_a_directory_exits_2(capsys):
    err = _exit2(capsys, ["--model-path", "Qwen/Qwen2.5-7B-Instruct"])
    assert "not a local directory" in err


@pytest.mark.parametrize("flags", [["--speedup", "0"], ["--max-running-requests", "-1"], ["--port", "70000"],
                                   ["--engine-flavor", "trt"], ["--startup-delay", "x"]])
def test_bad_values_exit_2(capsys, model_dir, flags):
    err = _exit2(capsys, ["--model-path", str(model_dir), *flags])
    assert flags[0] in err
