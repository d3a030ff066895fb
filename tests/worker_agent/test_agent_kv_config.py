"""The KV-events rule: what the agent adds to the engine command line, and where publishers are."""

import json

import pytest

from infera_worker_agent.engine_cmd import EngineArgsError, flag_value, plan_engine
from infera_worker_agent.kv_config import (
    KvSource, advertised_endpoint, block_size, block_size_notes, index_block_problem, index_block_size, local_endpoint,
    plan_kv_events, resolve_sources,
)


class Ports:
    """A port finder handing out blocks from 40000 and 50000, remembering what was asked."""

    def __init__(self) -> None:
        self.bases = [40000, 50000]
        self.asked: list[int] = []

    def __call__(self, n: int) -> int:
        self.asked.append(n)
        return self.bases.pop(0)


def config_of(argv) -> dict:
    raw = flag_value(list(argv), "--kv-events-config")
    assert raw is not None
    return json.loads(raw)


@pytest.mark.parametrize("engine", ["sglang", "mock"])
def test_sglang_and_mock_get_a_zmq_publisher_with_replay_on_free_ports(engine):
    ports = Ports()
    p = plan_engine(engine, ["--model-path", "/m"], python="py", free_port=30000, default_model_path="/m",
                    enable_kv_events=True, find_ports=ports)
    cfg = config_of(p.argv)
    assert cfg["publisher"] == "zmq"
    assert cfg["endpoint"] == "tcp://*:40000"
    assert cfg["replay_endpoint"] == "tcp://*:50000"
    assert cfg["topic"] == ""
    assert p.argv.count("--kv-events-config") == 1
    assert ports.asked == [1, 1]
    assert p.kv_events.sources == (KvSource(0, "tcp://*:40000", "tcp://*:50000"),)


def test_vllm_also_gets_enable_kv_cache_events():
    p = plan_engine("vllm", ["--model", "/m"], python="py", free_port=30000, default_model_path="/m",
                    enable_kv_events=True, find_ports=Ports())
    cfg = config_of(p.argv)
    assert cfg["enable_kv_cache_events"] is True
    assert cfg["publisher"] == "zmq"


@pytest.mark.parametrize("engine,args", [
    ("sglang", ["--dp-size", "4"]), ("sglang", ["--dp", "4"]),
    ("vllm", ["--data-parallel-size", "4"]), ("vllm", ["--data-parallel-size=4"]),
])
def test_one_contiguous_port_block_per_dp_rank(engine, args):
    ports = Ports()
    kv = plan_kv_events(engine, args, enabled=True, find_ports=ports)
    assert ports.asked == [4, 4]
    assert [s.endpoint for s in kv.sources] == [f"tcp://*:{40000 + r}" for r in range(4)]
    assert [s.replay_endpoint for s in kv.sources] == [f"tcp://*:{50000 + r}" for r in range(4)]
    assert [s.dp_rank for s in kv.sources] == [0, 1, 2, 3]


def test_user_config_is_kept_verbatim_and_its_endpoints_used():
    user = '{"publisher":"zmq","endpoint":"tcp://*:7000","replay_endpoint":"tcp://*:7100"}'
    ports = Ports()
    p = plan_engine("sglang", ["--dp-size", "2", "--kv-events-config", user], python="py", free_port=1,
                    default_model_path="/m", enable_kv_events=True, find_ports=ports)
    assert p.argv.count("--kv-events-config") == 1 and user in p.argv
    assert ports.asked == []
    assert p.kv_events.user_supplied and p.kv_events.enabled
    assert p.kv_events.sources == (KvSource(0, "tcp://*:7000", "tcp://*:7100"),
                                   KvSource(1, "tcp://*:7001", "tcp://*:7101"))


def test_user_config_that_does_not_publish_means_no_relay():
    kv = plan_kv_events("vllm", ["--kv-events-config", '{"publisher":"zmq"}'], enabled=True, find_ports=Ports())
    assert not kv.enabled and kv.sources == ()  # vLLM needs enable_kv_cache_events


def test_user_config_that_is_not_json_is_refused():
    with pytest.raises(EngineArgsError, match="kv-events-config"):
        plan_kv_events("sglang", ["--kv-events-config", "{nope"], enabled=True, find_ports=Ports())


def test_no_enable_kv_events_adds_nothing():
    ports = Ports()
    p = plan_engine("sglang", ["--model-path", "/m"], python="py", free_port=1, default_model_path="/m",
                    enable_kv_events=False, find_ports=ports)
    assert "--kv-events-config" not in p.argv
    assert ports.asked == [] and not p.kv_events.enabled


def test_bad_dp_size_is_refused():
    with pytest.raises(EngineArgsError, match="DP size"):
        plan_kv_events("sglang", ["--dp-size", "x"], enabled=True, find_ports=Ports())


def test_block_size_from_server_info_or_args():
    assert block_size("sglang", {"page_size": 64}, []) == 64
    assert block_size("mock", {"page_size": 32, "block_size": 32}, []) == 32
    assert block_size("vllm", {"block_size": 32}, []) == 32
    assert block_size("vllm", None, ["--block-size", "128"]) == 128
    assert block_size("vllm", None, []) == 16
    assert block_size("sglang", None, ["--page-size", "8"]) == 8


def test_engine_reports_win_over_the_plan():
    planned = [KvSource(0, "tcp://*:0", "tcp://*:0")]
    vllm = [{"data_parallel_rank": 0, "endpoint": "tcp://0.0.0.0:6001", "replay_endpoint": "tcp://0.0.0.0:6002",
             "topic": ""}]
    assert resolve_sources(planned, vllm, None) == (KvSource(0, "tcp://0.0.0.0:6001", "tcp://0.0.0.0:6002"),)
    sglang = {"kv_events": {"publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": 7000, "dp_size": 2}}
    planned2 = [KvSource(0, "tcp://*:7000", "tcp://*:8000"), KvSource(1, "tcp://*:7001", "tcp://*:8001")]
    assert resolve_sources(planned2, None, sglang) == (KvSource(0, "tcp://*:7000", "tcp://*:8000"),
                                                      KvSource(1, "tcp://*:7001", "tcp://*:8001"))
    assert resolve_sources(planned2, [], {"kv_events": None}) == tuple(planned2)


def test_vllm_0_32_answers_its_event_sources_as_a_map_by_rank():
    by_rank = {"1": {"endpoint": "tcp://127.0.0.1:6011", "replay_endpoint": None, "topic": ""},
               "0": {"endpoint": "tcp://127.0.0.1:6001", "replay_endpoint": "tcp://127.0.0.1:6002", "topic": ""}}
    assert resolve_sources([KvSource(0, "tcp://*:0")], by_rank, None) == (
        KvSource(0, "tcp://127.0.0.1:6001", "tcp://127.0.0.1:6002"), KvSource(1, "tcp://127.0.0.1:6011", None))


def test_wildcard_endpoints_are_reached_locally_and_advertised_at_the_advertise_host():
    assert local_endpoint("tcp://*:5557") == "tcp://127.0.0.1:5557"
    assert local_endpoint("tcp://0.0.0.0:5557") == "tcp://127.0.0.1:5557"
    assert local_endpoint("tcp://10.1.2.3:5557") == "tcp://10.1.2.3:5557"
    assert advertised_endpoint("tcp://*:5557", "10.0.0.5") == "tcp://10.0.0.5:5557"
    assert advertised_endpoint("tcp://0.0.0.0:5557", "fe80::1") == "tcp://[fe80::1]:5557"


@pytest.mark.parametrize("page,wanted,index", [
    (1, 0, 16), (2, 0, 16), (8, 0, 16), (3, 0, 18), (16, 0, 16), (64, 0, 64),  # 0: pages under 16 fold into 16
    (1, 64, 64), (16, 64, 64), (64, 64, 64), (1, 1, 1), (None, 0, None), (None, 64, None),
])
def test_the_index_block_size_folds_small_pages_and_keeps_what_is_asked(page, wanted, index):
    assert index_block_size(page, wanted) == (index, None)


def test_an_index_block_size_the_engines_page_does_not_divide_is_rounded_up_with_a_note():
    size, note = index_block_size(32, 48)  # the engine resolved another page than its flags said
    assert size == 64 and "--kv-index-block-size 48" in note and "multiple of 32" in note


def test_before_launch_only_a_page_size_the_flags_fix_is_checked():
    assert index_block_problem("sglang", 24, ["--page-size", "16"]) is not None
    assert index_block_problem("mock", 24, ["--page-size", "16"]) is not None
    assert "(--block-size 16)" in index_block_problem("sglang", 24, ["--block-size", "16"])  # the flag given
    assert "default --block-size 16" in index_block_problem("vllm", 24, [])
    assert index_block_problem("vllm", 24, ["--block-size", "8"]) is None
    assert index_block_problem("sglang", 24, []) is None  # the page is resolved at start (1 unless told)
    assert index_block_problem("sglang", 0, ["--page-size", "16"]) is None


def test_the_operator_is_told_when_pages_fold_when_the_flag_had_to_change_and_when_blocks_stay_small():
    assert [event for _, event, _ in block_size_notes(1, 0)] == ["kv_pages_folded"]
    assert [event for _, event, _ in block_size_notes(64, 0)] == []
    assert [(level, event) for level, event, _ in block_size_notes(1, 1)] == [("warning", "kv_block_size_small")]
    [(level, event, fields)] = block_size_notes(32, 48)
    assert (level, event, fields["index_block_size"]) == ("warning", "kv_index_block_size_changed", 64)
