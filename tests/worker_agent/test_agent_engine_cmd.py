"""The engine command line and the engine's URLs, from the agent's flags and the engine's own args."""

import pytest

from infera_worker_agent.engine_cmd import (
    EngineArgsError, engine_api_key, flag_value, redacted, health_generates, launch_problems, plan_engine, stats_problem,
)

PY = "/usr/bin/python3"
MODEL = "/models/SmolLM2"


def plan(engine, args, **kw):
    kw.setdefault("python", PY)
    kw.setdefault("free_port", 41234)
    kw.setdefault("default_model_path", MODEL)
    return plan_engine(engine, args, **kw)


def test_mock_without_port_or_model_gets_a_free_port_and_the_bundled_model():
    p = plan("mock", ["--speedup", "100"])
    assert p.argv == (PY, "-m", "infera_mock_engine", "--speedup", "100", "--port", "41234", "--model-path", MODEL)
    assert p.port == 41234
    assert p.local_url == "http://127.0.0.1:41234"
    assert p.url == "http://127.0.0.1:41234"
    assert p.model_hint == MODEL
    assert p.abort_path == "/abort_request"


def test_engine_args_are_passed_verbatim_and_in_order():
    args = ["--model-path", "/m", "--tp", "8", "--kv-events-config", '{"publisher": "zmq"}', "--port", "30001"]
    p = plan("sglang", args)
    assert p.argv[:3] == (PY, "-m", "sglang.launch_server")
    assert list(p.argv[3:3 + len(args)]) == args
    assert "41234" not in p.argv  # the given port is kept, no second --port
    assert p.port == 30001


def test_sglang_gets_metrics_enabled_once():
    assert plan("sglang", ["--model-path", "/m"]).argv.count("--enable-metrics") == 1
    assert plan("sglang", ["--model-path", "/m", "--enable-metrics"]).argv.count("--enable-metrics") == 1
    assert "--enable-metrics" not in plan("vllm", ["--model", "/m"]).argv


def test_vllm_module_served_name_and_no_abort_endpoint():
    p = plan("vllm", ["--model", "/m", "--port=8001", "--served-model-name", "llama", "alias"])
    assert p.argv[:3] == (PY, "-m", "vllm.entrypoints.openai.api_server")
    assert p.port == 8001
    assert p.model_hint == "llama"
    assert p.abort_path is None
    assert "--model-path" not in p.argv  # only the mock gets a default model


def test_wildcard_bind_is_reached_locally_and_advertised_as_told():
    p = plan("sglang", ["--host", "0.0.0.0", "--port", "30000"], advertise_host="10.1.2.3")
    assert p.local_url == "http://127.0.0.1:30000"
    assert p.url == "http://10.1.2.3:30000"
    assert p.advertise_host == "10.1.2.3"


def test_specific_bind_host_is_used_to_reach_and_to_advertise_by_default():
    p = plan("vllm", ["--host", "10.0.0.5", "--port", "8000"])
    assert p.local_url == "http://10.0.0.5:8000"
    assert p.url == "http://10.0.0.5:8000"


def test_ipv6_advertise_host_is_bracketed_in_the_url():
    p = plan("mock", [], advertise_host="fd00::5")
    assert p.url == "http://[fd00::5]:41234"
    assert p.advertise_host == "fd00::5"


@pytest.mark.parametrize("bad", ["abc", "0", "70000"])
def test_a_port_that_cannot_work_is_refused(bad):
    with pytest.raises(EngineArgsError, match="--port"):
        plan("sglang", ["--port", bad])


def test_mock_positional_model_is_not_doubled():
    p = plan("mock", ["serve", "/my/model", "--speedup", "2"])
    assert "--model-path" not in p.argv
    assert p.model_hint == "/my/model"


def test_model_alias_counts_as_a_model_for_the_mock():
    p = plan("mock", ["--model", "/other"])
    assert "--model-path" not in p.argv and p.model_hint == "/other"


def test_flag_value_follows_argparse_last_one_wins():
    assert flag_value(["--port", "1", "--port=2"], "--port") == "2"
    assert flag_value(["--model-path=/a"], "--model") is None
    assert flag_value(["--model-path=/a"], "--model-path", "--model") == "/a"
    assert flag_value(["--port"], "--port") is None


@pytest.mark.parametrize("engine, args, env", [
    ("sglang", ["--model-path", "/m", "--api-key", "s3cret"], {}),
    ("vllm", ["--model", "/m", "--api_key=s3cret"], {}),
    ("vllm", ["--model", "/m"], {"VLLM_API_KEY": "s3cret"}),
    ("mock", ["--api-key", "s3cret"], {}),
    ("mock", ["--engine-flavor", "vllm"], {"VLLM_API_KEY": "s3cret"}),
])
def test_the_key_an_engine_asks_for_is_read_where_the_engine_reads_it(engine, args, env):
    assert engine_api_key(engine, args, env) == "s3cret"
    plan = plan_engine(engine, args, python="py", free_port=9, default_model_path="/m", env=env)
    assert plan.api_key == "s3cret"
    assert "s3cret" not in str(redacted(plan.argv))  # what the agent logs of the command line


def test_a_logged_command_line_hides_the_key_whichever_way_it_is_written():
    assert redacted(["x", "--api-key", "k", "--port", "1"]) == ["x", "--api-key", "***", "--port", "1"]
    assert redacted(["--api_key=k", "--api-keys", "v"]) == ["--api_key=***", "--api-keys", "v"]


def test_no_key_where_the_engine_reads_none():
    assert engine_api_key("sglang", ["--model-path", "/m"], {"VLLM_API_KEY": "x"}) is None  # vLLM's variable
    assert engine_api_key("mock", [], {"VLLM_API_KEY": "x"}) is None  # an SGLang-flavoured mock
    assert engine_api_key("vllm", ["--model", "/m"], {}) is None


@pytest.mark.parametrize("args", [["--model", "/m", "--disable-log-stats"], ["--model", "/m", "--disable_log_stats"]])
def test_a_vllm_without_its_metrics_is_refused_with_the_quiet_way_to_keep_them(args):
    problem = stats_problem("vllm", args)
    assert problem is not None and "Remove it" in problem and "VLLM_LOGGING_LEVEL=WARNING" in problem


def test_stats_are_only_a_problem_for_vllm_and_problems_add_up():
    assert stats_problem("vllm", ["--model", "/m", "--disable-log-requests"]) is None
    assert stats_problem("sglang", ["--model-path", "/m", "--disable-log-stats"]) is None  # not SGLang's flag
    assert stats_problem("mock", ["--disable-log-stats"]) is None
    [problem] = launch_problems("vllm", ["--model", "/m", "--disable-log-stats", "--api-key", "k"], {})
    assert "--disable-log-stats" in problem  # (an engine key is sent, not refused)
    assert launch_problems("vllm", ["--model", "/m"], {}) == []


@pytest.mark.parametrize("engine, args, env, deep", [
    ("sglang", ["--model-path", "/m"], {}, True),  # SGLang's /health generates by default
    ("sglang", ["--model-path", "/m"], {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false"}, False),
    ("sglang", ["--model-path", "/m"], {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "N"}, False),
    ("sglang", ["--model-path", "/m"], {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "1"}, True),
    ("vllm", ["--model", "/m"], {}, False),  # vLLM's only asks whether the engine core lives
    ("mock", [], {}, True),  # the mock's default flavour is sglang
    ("mock", ["--engine-flavor", "vllm"], {}, False),
    ("mock", ["--engine-flavour=sglang"], {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0"}, False),
])
def test_which_engines_test_themselves_on_every_health_probe(engine, args, env, deep):
    assert health_generates(engine, args, env) is deep
