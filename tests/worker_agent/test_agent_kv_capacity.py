"""The engine's KV capacity per DP rank, and its context length, as the worker-agent reads them for
the record (pure)."""

import pytest

from infera_worker_agent.health import ModelCard, refused_length, read_models
from infera_worker_agent.kv_capacity import capacity_tokens

#: vLLM 0.32's info gauge: every CacheConfig field as a label (a few of them here), per DP engine.
VLLM_METRICS = """\
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",cache_dtype="auto",enable_prefix_caching="True",engine="1",kv_cache_size_tokens="8000",num_gpu_blocks="250"} 1.0
vllm:cache_config_info{block_size="32",cache_dtype="auto",enable_prefix_caching="True",engine="0",kv_cache_size_tokens="12320",num_gpu_blocks="385"} 1.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 0.0
"""


def test_sglang_and_the_mock_say_it_in_server_info():
    info = {"page_size": 1, "max_total_num_tokens": 812_345, "internal_states": []}
    assert capacity_tokens("sglang", info, None) == 812_345
    assert capacity_tokens("mock", {"max_total_num_tokens": 4096}, None) == 4096
    for bad in (None, {}, {"max_total_num_tokens": 0}, {"max_total_num_tokens": True},
                {"max_total_num_tokens": "4096"}):
        assert capacity_tokens("sglang", bad, None) is None


def test_vllm_says_it_in_its_cache_config_info_gauge_engine_0_first():
    assert capacity_tokens("vllm", None, VLLM_METRICS) == 12_320


def test_vllm_without_kv_cache_size_tokens_is_blocks_times_block_size():
    older = VLLM_METRICS.replace('kv_cache_size_tokens="12320",', 'kv_cache_size_tokens="None",')
    assert capacity_tokens("vllm", None, older) == 385 * 32
    none = older.replace('num_gpu_blocks="385"', 'num_gpu_blocks="None"').replace('engine="1"', 'engine="2"')
    none = none.replace('kv_cache_size_tokens="8000"', 'kv_cache_size_tokens="None"')
    assert capacity_tokens("vllm", None, none) == 250 * 32  # engine 0 says nothing: the next one


def test_vllm_without_the_gauge_or_with_garbage_is_unknown():
    assert capacity_tokens("vllm", {"max_total_num_tokens": 5}, None) is None  # vLLM has no /server_info
    assert capacity_tokens("vllm", None, 'vllm:num_requests_running{engine="0"} 0.0\n') is None
    assert capacity_tokens("vllm", None, "not { prometheus") is None


@pytest.mark.parametrize("card, info, expected", [
    (ModelCard("m", 131072), {"allow_auto_truncate": False}, 131072),
    (ModelCard("m", 131072), None, 131072),  # vLLM: no /server_info
    (ModelCard("m", 131072), {"allow_auto_truncate": True}, None),  # SGLang cuts long prompts: not an error
    (ModelCard("m"), {}, None),  # the engine did not say
    (None, {}, None),
])
def test_the_context_length_advertised_is_the_one_the_engine_refuses_at(card, info, expected):
    assert refused_length(card, info) == expected


def test_the_engines_model_list_gives_the_served_name_its_aliases_and_its_adapters():
    vllm = [{"id": "qwen", "parent": None, "max_model_len": 4096}, {"id": "qwen-latest", "parent": None},
            {"id": "sql-lora", "parent": "qwen"}, {"id": "qwen"}, {"object": "model"}, "junk",
            {"id": "chat-lora", "parent": "qwen", "root": "/adapters/chat"}, {"id": "qwen-latest", "parent": "qwen"}]
    assert read_models(vllm) == ModelCard("qwen", 4096, ("qwen-latest",), ("sql-lora", "chat-lora"))
    assert read_models([{"id": "smol"}]) == ModelCard("smol", None, ())  # SGLang: one served name
    assert read_models([]) is None and read_models([{"object": "model"}]) is None and read_models(None) is None
