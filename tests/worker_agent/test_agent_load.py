"""Engine load from /metrics text, both engine flavours."""

import pytest

from infera_worker_agent.load import EngineLoad, parse_engine_metrics

SGLANG = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m",engine_type="unified",tp_rank="0"} 3.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m",engine_type="unified",tp_rank="0"} 5.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m",engine_type="unified",tp_rank="0"} 0.42
# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="m"} 12345.0
"""

VLLM = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 4.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.2
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.6
# HELP vllm:gpu_cache_usage_perc Older name.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.9
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{model_name="m"} 99.0
"""


def test_sglang_names():
    assert parse_engine_metrics(SGLANG) == EngineLoad(running=3, waiting=5, kv_usage=pytest.approx(0.42))


def test_vllm_names_summed_over_dp_ranks_and_one_kv_name_only():
    assert parse_engine_metrics(VLLM) == EngineLoad(running=6, waiting=1, kv_usage=pytest.approx(0.4))


def test_older_vllm_kv_name():
    text = "# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc 0.25\n"
    assert parse_engine_metrics(text) == EngineLoad(0, 0, 0.25)


def test_usage_is_clamped_to_a_fraction():
    assert parse_engine_metrics("sglang:token_usage 1.7\n").kv_usage == 1.0


def test_page_without_engine_load_series():
    assert parse_engine_metrics("# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 3.0\n") is None
    assert parse_engine_metrics("") is None


def test_garbage_is_a_value_error():
    with pytest.raises(ValueError):
        parse_engine_metrics("sglang:num_running_reqs{model= 3 garbage\n")
