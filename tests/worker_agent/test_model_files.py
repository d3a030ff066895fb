"""A model or tokenizer path the engine could not use is refused before the engine's cold start."""

import pytest

from infera_worker_agent.model_files import PathLook, look_path, path_problems

MISSING = PathLook(exists=False)
MODEL_DIR = PathLook(exists=True, is_dir=True, has_config=True)


def looking_at(paths: dict[str, PathLook] | None = None):
    """A filesystem holding only ``paths``; ``look.seen`` lists what was looked at."""
    seen: list[str] = []

    def look(path: str) -> PathLook:
        seen.append(path)
        return (paths or {}).get(path, MISSING)

    look.seen = seen
    return look


@pytest.mark.parametrize("engine,args,flag", [
    ("sglang", ["--model-path", "/models/DeepSeek-R1", "--tp", "8"], "--model-path"),
    ("sglang", ["--model", "/models/DeepSeek-R1"], "--model"),  # SGLang's alias
    ("vllm", ["--model", "/models/DeepSeek-R1"], "--model"),
    ("vllm", ["--model=/models/DeepSeek-R1"], "--model"),
    ("vllm", ["--model", "./models/DeepSeek-R1"], "--model"),
])
def test_a_model_path_that_is_not_there_is_named_with_its_flag(engine, args, flag):
    [problem] = path_problems(engine, args, looking_at())
    assert f"the engine argument {flag} " in problem and "models/DeepSeek-R1 does not exist on this host" in problem


@pytest.mark.parametrize("name", ["deepseek-ai/DeepSeek-R1", "Qwen3-8B", "models/DeepSeek-R1"])
def test_a_name_that_may_be_a_repo_id_is_left_to_the_engine(name):
    look = looking_at()
    assert path_problems("vllm", ["--model", name], look) == []
    assert look.seen == []


def test_the_folder_above_the_model_is_refused_with_the_models_inside_it():
    look = looking_at({"/models": PathLook(exists=True, is_dir=True, models_inside=("/models/A", "/models/B"))})
    [problem] = path_problems("sglang", ["--model-path", "/models"], look)
    assert "--model-path /models is a directory without a model's config.json" in problem
    assert "the model directories in it: /models/A, /models/B" in problem


def test_a_model_directory_a_gguf_file_and_vllms_separate_config_pass():
    assert path_problems("sglang", ["--model-path", "/m"], looking_at({"/m": MODEL_DIR})) == []
    assert path_problems("vllm", ["--model", "/m.gguf"], looking_at({"/m.gguf": PathLook(exists=True)})) == []
    bare = looking_at({"/m": PathLook(exists=True, is_dir=True)})
    assert path_problems("vllm", ["--model", "/m", "--hf-config-path", "/cfg"], bare) == []
    assert path_problems("vllm", ["--model", "/m", "--hf_config_path", "/cfg"], bare) == []  # vLLM reads _ as -


@pytest.mark.parametrize("engine,flag", [("sglang", "--tokenizer-path"), ("vllm", "--tokenizer")])
def test_a_tokenizer_path_that_is_not_there_is_named(engine, flag):
    model = "--model-path" if engine == "sglang" else "--model"
    [problem] = path_problems(engine, [model, "/m", flag, "/tok"], looking_at({"/m": MODEL_DIR}))
    assert f"the engine argument {flag} /tok does not exist" in problem


def test_the_mock_engine_checks_its_own_path():
    assert path_problems("mock", ["--model-path", "/nowhere"], looking_at()) == []


def test_look_path_reads_the_disk(tmp_path):
    (tmp_path / "A").mkdir()
    (tmp_path / "A" / "config.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    (tmp_path / "w.gguf").write_bytes(b"GGUF")
    assert look_path(str(tmp_path / "A")) == MODEL_DIR
    assert look_path(str(tmp_path)) == PathLook(exists=True, is_dir=True, models_inside=(str(tmp_path / "A"),))
    assert look_path(str(tmp_path / "w.gguf")) == PathLook(exists=True)
    assert look_path(str(tmp_path / "nope")) == MISSING
    [problem] = path_problems("vllm", ["--model", str(tmp_path / "empty")])
    assert "without a model's config.json" in problem and "model directories in it" not in problem
