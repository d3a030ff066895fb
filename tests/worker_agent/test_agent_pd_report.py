"""After health the engine's own report of its role, bootstrap port, engine id and DP size wins."""

import json

from infera_common.schemas import PdParams, Role
from infera_worker_agent.pd_report import (
    bootstrap_query_url, needs_bootstrap_query, query_engine_id, reported_state,
)
from infera_worker_agent.pd_role import plan_pd

HOST = "10.0.0.7"
PRODUCER = json.dumps({"kv_connector": "MooncakeConnector", "kv_role": "kv_producer"})
BOTH = json.dumps({"kv_connector": "MooncakeConnector", "kv_role": "kv_both"})


def plan(engine, args, env=None, role=None):
    return plan_pd(engine, args, env=env or {}, role=role)


def mock_info(mode, port=None, engine_id=None, dp=1, protocol="sglang-bootstrap"):
    """The mock's /server_info, the parts the agent reads."""
    return {"dp_size": dp, "disaggregation_mode": mode, "disaggregation_bootstrap_port": port or 8998,
            "disaggregation": {"mode": mode, "protocol": protocol, "bootstrap_port": port, "engine_id": engine_id}}


def test_the_bootstrap_port_the_mock_bound_replaces_port_0():
    p = plan("mock", ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", "0"])
    s, notes = reported_state(p, HOST, mock_info("prefill", port=41001))
    assert (s.role, s.pd, notes) == (
        Role.PREFILL, PdParams(protocol="sglang-bootstrap", bootstrap_host=HOST, bootstrap_port=41001), [])


def test_an_unreported_port_0_is_registered_unknown_with_a_note():
    p = plan("mock", ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", "0"])
    s, notes = reported_state(p, HOST, None)
    assert s.pd.bootstrap_port is None and "bootstrap port is unknown" in notes[0]


def test_sglang_server_info_mode_wins_over_the_flags_and_says_so():
    # e.g. set in an SGLang --config file the agent does not read
    info = {"disaggregation_mode": "prefill", "disaggregation_bootstrap_port": 9100, "dp_size": 2}
    s, notes = reported_state(plan("sglang", []), HOST, info)
    assert (s.role, s.dp_size) == (Role.PREFILL, 2)
    assert s.pd == PdParams(protocol="sglang-bootstrap", bootstrap_host=HOST, bootstrap_port=9100)
    assert "reports disaggregation mode 'prefill'" in notes[0]


def test_an_aggregated_report_registers_no_pd_parameters():
    s, _ = reported_state(plan("sglang", ["--disaggregation-mode", "decode"]), HOST, mock_info("null"))
    assert (s.role, s.pd) == (Role.AGGREGATED, None)


def test_kv_both_reported_as_both_keeps_the_role_the_agent_picked():
    p = plan("mock", ["--engine-flavor", "vllm", "--kv-transfer-config", BOTH], role="prefill")
    s, notes = reported_state(p, HOST, mock_info("both", port=8998, engine_id="e1", protocol="vllm-mooncake"))
    assert (s.role, s.pd.engine_id, s.pd.bootstrap_port, notes) == (Role.PREFILL, "e1", 8998, [])


def test_vllm_engine_id_from_the_bootstrap_query_without_the_dp_suffix():
    p = plan("vllm", ["--kv-transfer-config", PRODUCER, "-dp", "2"])
    query = {"0": {"engine_id": "abc_dp0", "worker_addr": {}}, "1": {"engine_id": "abc_dp1", "worker_addr": {}}}
    s, notes = reported_state(p, HOST, None, query)
    assert (s.pd.engine_id, s.dp_size, notes) == ("abc", 2, [])


def test_query_engine_id_keeps_a_single_ranks_id_whole():
    assert query_engine_id({"0": {"engine_id": "x_dp0"}}, 1) == "x_dp0"
    assert query_engine_id({"0": {"engine_id": "x_dp0"}, "1": {"engine_id": "x_dp1"}}, 1) == "x"
    assert query_engine_id({}, 1) is None and query_engine_id(["x"], 1) is None


def test_the_engines_engine_id_wins_and_a_missing_one_is_noted():
    config = json.dumps({"kv_connector": "MooncakeConnector", "kv_role": "kv_producer", "engine_id": "cfg"})
    p = plan("mock", ["--engine-flavor", "vllm", "--kv-transfer-config", config])
    assert reported_state(p, HOST, mock_info("prefill", engine_id="cfg", protocol="vllm-mooncake"))[0].pd.engine_id == "cfg"
    s, notes = reported_state(plan("vllm", ["--kv-transfer-config", PRODUCER]), HOST, None, None)
    assert s.pd.engine_id is None and "engine id is unknown" in notes[0]
    s, _ = reported_state(p, HOST, None, None)  # nothing reported: the configured id
    assert s.pd.engine_id == "cfg"


def test_who_is_asked_for_the_engine_id():
    vllm_prefill = plan("vllm", ["--kv-transfer-config", PRODUCER])
    assert needs_bootstrap_query(vllm_prefill, None)  # real vLLM has no /server_info
    mock_prefill = plan("mock", ["--engine-flavor", "vllm", "--kv-transfer-config", PRODUCER])
    assert not needs_bootstrap_query(mock_prefill, mock_info("prefill", engine_id="e", protocol="vllm-mooncake"))
    assert not needs_bootstrap_query(plan("vllm", ["--kv-transfer-config", BOTH]), None)  # aggregated
    assert not needs_bootstrap_query(plan("sglang", ["--disaggregation-mode", "prefill"]), None)


def test_bootstrap_query_goes_to_the_local_engine_or_the_external_server():
    p = plan("vllm", ["--kv-transfer-config", PRODUCER], env={"VLLM_MOONCAKE_BOOTSTRAP_PORT": "9200"})
    assert bootstrap_query_url(p, "127.0.0.1") == "http://127.0.0.1:9200/query"
    config = {"kv_connector": "MooncakeConnector", "kv_role": "kv_producer",
              "kv_connector_extra_config": {"bootstrap_server_address": "[fd00::1]:7000"}}
    external = plan("vllm", ["--kv-transfer-config", json.dumps(config)])
    assert bootstrap_query_url(external, "127.0.0.1") == "http://[fd00::1]:7000/query"
    s, _ = reported_state(external, HOST, None, {"0": {"engine_id": "e"}})
    assert (s.pd.bootstrap_host, s.pd.bootstrap_port) == ("fd00::1", 7000)


def test_dp_size_from_server_info_wins():
    s, _ = reported_state(plan("sglang", ["--dp", "2"]), HOST, {"dp_size": 4})
    assert s.dp_size == 4
    assert reported_state(plan("sglang", ["--dp", "2"]), HOST, {"dp_size": "x"})[0].dp_size == 2


async def test_the_engine_id_is_asked_of_vllms_bootstrap_server_until_its_ranks_registered():
    from aiohttp import ClientSession, web
    from aiohttp.test_utils import TestServer

    from infera_worker_agent.health import bootstrap_ranks

    answers = [{}, {"0": {"engine_id": "gen_dp0", "worker_addr": {}}, "1": {"engine_id": "gen_dp1"}}]

    async def query(_request):
        return web.json_response(answers.pop(0) if len(answers) > 1 else answers[0])

    app = web.Application()
    app.router.add_get("/query", query)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        p = plan("vllm", ["--kv-transfer-config", PRODUCER, "-dp", "2"],
                 env={"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(server.port)})
        async with ClientSession() as session:
            data = await bootstrap_ranks(session, bootstrap_query_url(p, "127.0.0.1"), interval=0.01)
            missing = await bootstrap_ranks(session, f"http://127.0.0.1:{server.port}/nothing", attempts=2,
                                            interval=0.01)
        s, notes = reported_state(p, HOST, None, data)
        assert (s.pd.engine_id, s.pd.bootstrap_port, notes) == ("gen", server.port, [])
        assert missing is None
    finally:
        await server.close()
