"""--kv-events-config read the way each engine reads it; endpoint rules; bad configs exit 2."""

import json
import subprocess
import sys
import time

import pytest

from infera_mock_engine.kv_events_config import (
    KvEventsConfigError, binds, offset_endpoint_port, parse_kv_events_config,
)
from infera_mock_engine.main import parse_args


def test_vllm_publishes_only_with_enable_kv_cache_events():
    cfg, _ = parse_kv_events_config('{"enable_kv_cache_events": true}', "vllm")
    assert cfg.publishes and cfg.publisher == "zmq" and cfg.endpoint == "tcp://*:5557"  # publisher defaults to zmq
    assert (cfg.replay_endpoint, cfg.buffer_steps, cfg.hwm, cfg.topic) == (None, 10000, 100000, "")
    cfg, _ = parse_kv_events_config('{"publisher": "zmq", "endpoint": "tcp://*:6000"}', "vllm")
    assert not cfg.publishes
    cfg, _ = parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "null"}', "vllm")
    assert not cfg.publishes


def test_sglang_ignores_enable_kv_cache_events_and_needs_publisher_zmq():
    cfg, ignored = parse_kv_events_config('{"enable_kv_cache_events": true}', "sglang")
    assert not cfg.publishes and ignored == ["enable_kv_cache_events"]
    cfg, ignored = parse_kv_events_config(
        '{"publisher": "zmq", "enable_kv_cache_events": false, "replay_endpoint": "tcp://*:5558", '
        '"topic": "kv", "buffer_steps": 5, "future_key": 1}', "sglang")
    assert cfg.publishes and (cfg.replay_endpoint, cfg.topic, cfg.buffer_steps) == ("tcp://*:5558", "kv", 5)
    assert ignored == ["future_key"]  # unknown keys are ignored by SGLang's pydantic model


@pytest.mark.parametrize("text,flavor,message", [
    ("{publisher: zmq}", "sglang", "not valid JSON"),
    ('["zmq"]', "vllm", "expected a JSON object"),
    ('{"publisher": "kafka"}', "sglang", "unknown publisher 'kafka'"),
    ('{"enable_kv_cache_events": true, "publisher": "nats"}', "vllm", "unknown publisher 'nats'"),
    ('{"enable_kv_cache_events": true, "endpiont": "tcp://*:1"}', "vllm", "unknown key(s) 'endpiont'"),
    ('{"publisher": "zmq", "endpoint": "tcp://*"}', "sglang", "tcp://HOST:PORT"),
    ('{"publisher": "zmq", "endpoint": "udp://x:1"}', "sglang", "must be tcp://"),
    ('{"publisher": "zmq", "buffer_steps": 0}', "sglang", "'buffer_steps' must be an integer >= 1"),
    ('{"enable_kv_cache_events": "yes"}', "vllm", "must be true or false"),
])
def test_unusable_configs_are_refused_with_the_reason(text, flavor, message):
    with pytest.raises(KvEventsConfigError) as e:
        parse_kv_events_config(text, flavor)
    assert message in str(e.value)


def test_bind_or_connect_and_dp_rank_port_offsets():
    assert binds("tcp://*:5557") and binds("tcp://[::]:5557") and binds("ipc:///tmp/kv")
    assert not binds("tcp://10.0.0.1:5557") and not binds("tcp://localhost:5557")
    assert offset_endpoint_port("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint_port("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_endpoint_port("tcp://10.0.0.1:5557", 1) == "tcp://10.0.0.1:5558"
    assert offset_endpoint_port("tcp://*:0", 2) == "tcp://*:0"  # a free port for every rank
    assert offset_endpoint_port("inproc://kv", 1) == "inproc://kv_dp1"
    assert offset_endpoint_port(None, 1) is None


def test_parse_args_keeps_the_config(model_dir):
    cfg, _ = parse_args(["--model-path", str(model_dir), "--engine-flavor", "vllm", "--kv-events-config",
                         json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://*:0"})])
    assert cfg.publishes_kv_events and cfg.kv_events.endpoint == "tcp://*:0"
    assert cfg.public()["kv_events_config"]["endpoint"] == "tcp://*:0"
    cfg, _ = parse_args(["--model-path", str(model_dir)])
    assert cfg.kv_events is None and not cfg.publishes_kv_events


@pytest.mark.parametrize("value", ["{not json", '{"publisher": "kafka"}'])
def test_bad_kv_events_config_exits_2(capsys, model_dir, value):
    with pytest.raises(SystemExit) as e:
        parse_args(["--model-path", str(model_dir), "--kv-events-config", value])
    assert e.value.code == 2
    assert "--kv-events-config" in capsys.readouterr().err


def test_bad_kv_events_config_fails_the_process_fast(model_dir, subprocess_env):
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "infera_mock_engine", "--model-path", str(model_dir),
                          "--engine-flavor", "vllm", "--kv-events-config", '{"enable_kv_cache_events": tru}'],
                         capture_output=True, text=True, env=subprocess_env, timeout=30)
    assert res.returncode == 2 and "--kv-events-config: not valid JSON" in res.stderr
    assert time.monotonic() - t0 < 10


def test_a_busy_kv_events_port_fails_the_process_with_exit_1(model_dir, subprocess_env):
    import zmq

    ctx = zmq.Context()
    taken = ctx.socket(zmq.PUB)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    try:
        res = subprocess.run([sys.executable, "-m", "infera_mock_engine", "--model-path", str(model_dir), "--port", "0",
                              "--kv-events-config", json.dumps({"publisher": "zmq", "endpoint": f"tcp://*:{port}"})],
                             capture_output=True, text=True, env=subprocess_env, timeout=30)
    finally:
        taken.close(linger=0)
        ctx.term()
    assert res.returncode == 1 and f"cannot bind the KV events endpoint 'tcp://*:{port}'" in res.stderr
