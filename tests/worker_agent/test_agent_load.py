"""Engine load from /metrics text, both engine flavours, and the load report built from it."""

import pytest

from infera_worker_agent.load import EngineLoad, LoadReporter, engine_unseen, parse_engine_metrics

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
# HELP sglang:generation_tokens_total Number of generation tokens processed.
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{model_name="m"} 55.0
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
    assert parse_engine_metrics(SGLANG) == EngineLoad(running=3, waiting=5, kv_usage=pytest.approx(0.42),
                                                      tokens=12400.0)


def test_vllm_names_summed_over_dp_ranks_and_one_kv_name_only():
    assert parse_engine_metrics(VLLM) == EngineLoad(running=6, waiting=1, kv_usage=pytest.approx(0.4), tokens=99.0)


def test_older_vllm_kv_name():
    text = "# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc 0.25\n"
    assert parse_engine_metrics(text) == EngineLoad(0, 0, 0.25)


def test_usage_is_clamped_to_a_fraction():
    assert parse_engine_metrics("sglang:token_usage 1.7\n").kv_usage == 1.0


def test_page_without_engine_load_series():
    assert parse_engine_metrics("# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 3.0\n") is None
    assert parse_engine_metrics("") is None
    assert parse_engine_metrics("vllm:generation_tokens_total 7.0\n") is None  # counters alone are no load


def test_an_engine_without_token_counters_has_no_progress_mark():
    text = "vllm:num_requests_running 1.0\n"
    assert parse_engine_metrics(text).tokens is None


def test_garbage_is_a_value_error():
    with pytest.raises(ValueError):
        parse_engine_metrics("sglang:num_running_reqs{model= 3 garbage\n")


def test_requests_beside_the_agent_are_the_engines_less_the_agents_count_around_the_scrape():
    assert engine_unseen(EngineLoad(running=3, waiting=1), 2, 2) == 2  # two clients straight at the engine
    assert engine_unseen(EngineLoad(running=2), 2, 1) == 0  # one ended while the scrape was under way
    assert engine_unseen(EngineLoad(running=2), 1, 2) == 0  # one started then
    assert engine_unseen(EngineLoad(running=0), 2, 2) == 0  # not reached the engine yet: never negative


def reporter(in_flight, scrapes):
    published = []

    async def publish(report):
        published.append(report)

    r = LoadReporter(worker_id="w", session=None, metrics_url="http://unused", interval=1.0,
                     in_flight=lambda: in_flight[0], publish=publish)

    async def scrape():
        result = scrapes.pop(0)
        in_flight[0] -= 1  # a request ends while the engine's figures are read
        if isinstance(result, Exception):
            raise result
        return result

    r.scrape = scrape
    return r


async def test_a_request_ending_during_the_scrape_is_not_reported_as_someone_elses():
    in_flight = [3]
    r = reporter(in_flight, [EngineLoad(running=3), EngineLoad(running=3), OSError("engine gone")])
    report = await r.report_once()
    # the engine still counted the request that ended: 3 - 2 would be a phantom request
    assert (report.in_flight, report.engine_running, report.engine_unseen) == (2, 3, 0)
    in_flight[0] = 2  # the agent's two (one ending during the scrape) and a client calling the engine itself
    assert (await r.report_once()).engine_unseen == 1  # 3 - max(2, 1)
    # a failed scrape says nothing new: the last consistent figure stays
    assert (await r.report_once()).engine_unseen == 1


async def test_the_engine_counts_each_of_n_samples_and_so_does_the_report():
    """A request for 4 samples runs 4 sequences in the engine: none of them is someone else's."""
    published = []

    async def publish(report):
        published.append(report)

    r = LoadReporter(worker_id="w", session=None, metrics_url="http://unused", interval=1.0,
                     in_flight=lambda: 1, sequences=lambda: 4, publish=publish)

    async def scrape():
        return EngineLoad(running=4, waiting=1)

    r.scrape = scrape
    report = await r.report_once()
    assert (report.in_flight, report.engine_running, report.engine_unseen) == (1, 4, 1)  # the waiting one
    assert report.in_flight_sequences == 4  # what a least-loaded router weighs the worker by
