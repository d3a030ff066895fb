"""Which adapters a vLLM engine's filesystem LoRA resolver would load, as the worker-agent registers them."""

from __future__ import annotations

import json

import pytest

from infera_worker_agent.health import ModelCard, read_models
from infera_worker_agent.lora_resolver import adapters_in, resolver_dir, with_adapters

ON = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true", "VLLM_LORA_RESOLVER_CACHE_DIR": "/loras"}


@pytest.mark.parametrize("family, env, args, expected", [
    ("vllm", ON, ["--enable-lora"], "/loras"),
    ("vllm", {**ON, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}, ["--enable_lora"], "/loras"),
    ("vllm", {**ON, "VLLM_PLUGINS": "x,lora_filesystem_resolver"}, ["--enable-lora=true"], "/loras"),
    ("sglang", ON, ["--enable-lora"], None),  # SGLang has no such resolver
    ("vllm", {**ON, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "yes"}, ["--enable-lora"], None),  # vLLM: "1"/"true"
    ("vllm", {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"}, ["--enable-lora"], None),
    ("vllm", {**ON, "VLLM_PLUGINS": ""}, ["--enable-lora"], None),  # no plugin loaded
    ("vllm", ON, [], None),  # vLLM would find the adapter and fail to load it
    ("vllm", ON, ["--enable-lora", "--no-enable-lora"], None),
])
def test_an_engine_resolves_adapters_only_as_vllm_would(family, env, args, expected):
    assert resolver_dir(family, env, args) == expected


def test_the_adapters_listed_are_those_the_resolver_would_load_for_the_engines_model(tmp_path):
    def adapter(name: str, config: object) -> None:
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text(json.dumps(config))

    adapter("sql", {"peft_type": "LORA", "base_model_name_or_path": "/models/smol"})
    adapter("chat", {"peft_type": "LORA", "base_model_name_or_path": "/models/smol", "r": 16})
    adapter("elsewhere", {"peft_type": "LORA", "base_model_name_or_path": "/models/other"})
    adapter("ia3", {"peft_type": "IA3", "base_model_name_or_path": "/models/smol"})
    adapter("listy", ["not", "a", "config"])
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "adapter_config.json").write_text("{")
    (tmp_path / "empty").mkdir()
    (tmp_path / "a-file").write_text("x")
    assert adapters_in(str(tmp_path), "/models/smol") == ("chat", "sql")
    assert adapters_in(str(tmp_path), None) == ()  # the engine's model path unknown
    assert adapters_in(str(tmp_path / "missing"), "/models/smol") == ()


def test_resolvable_adapters_join_the_card_after_the_listed_ones():
    card = read_models([{"id": "smol", "root": "/models/smol"}, {"id": "sql", "parent": "smol", "root": "/a/sql"}])
    assert card == ModelCard("smol", None, (), ("sql",), "/models/smol")
    assert with_adapters(card, ("chat", "sql", "smol")).adapters == ("sql", "chat")
    assert with_adapters(card, ()) is card
