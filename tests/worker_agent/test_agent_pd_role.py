"""The serving role and PD parameters read from the engine's command line, rule by rule."""

import json

import pytest

from infera_common.schemas import PdParams, Role
from infera_worker_agent.engine_cmd import EngineArgsError, plan_engine
from infera_worker_agent.main import main
from infera_worker_agent.pd_report import planned_state
from infera_worker_agent.pd_role import plan_pd

HOST = "10.0.0.7"  # the agent's advertise host
PRODUCER = json.dumps({"kv_connector": "MooncakeConnector", "kv_role": "kv_producer"})
CONSUMER = json.dumps({"kv_connector": "MooncakeConnector", "kv_role": "kv_consumer"})
BOTH = json.dumps({"kv_connector": "MooncakeConnector", "kv_role": "kv_both"})


def state(engine, args, env=None, role=None):
    """What the starting record would carry: (role, pd, dp_size)."""
    s = planned_state(plan_pd(engine, args, env=env or {}, role=role), HOST)
    return s.role, s.pd, s.dp_size


def refused(engine, args, env=None, role=None) -> str:
    with pytest.raises(EngineArgsError) as exc:
        plan_pd(engine, args, env=env or {}, role=role)
    return str(exc.value)


# --- SGLang: --disaggregation-mode -----------------------------------------------------------------
@pytest.mark.parametrize("args", [[], ["--disaggregation-mode", "null"], ["--disaggregation-mode=null"]])
def test_sglang_without_a_disaggregation_mode_is_aggregated(args):
    assert state("sglang", args) == (Role.AGGREGATED, None, 1)


def test_sglang_prefill_bootstraps_on_the_default_port_at_the_advertise_host():
    assert state("sglang", ["--disaggregation-mode", "prefill"]) == (
        Role.PREFILL, PdParams(protocol="sglang-bootstrap", bootstrap_host=HOST, bootstrap_port=8998), 1)


def test_sglang_prefill_bootstrap_port_from_its_flag():
    _, pd, _ = state("sglang", ["--disaggregation-mode=prefill", "--disaggregation-bootstrap-port=9001"])
    assert (pd.bootstrap_host, pd.bootstrap_port) == (HOST, 9001)


def test_sglang_decode_has_no_bootstrap_address():
    assert state("sglang", ["--disaggregation-mode", "decode", "--disaggregation-bootstrap-port", "9001"]) == (
        Role.DECODE, PdParams(protocol="sglang-bootstrap"), 1)


@pytest.mark.parametrize("args", [[], ["--engine-flavor", "sglang"], ["--engine-flavour", "sglang"]])
def test_the_mock_in_its_sglang_flavour_follows_sglang(args):
    role, pd, _ = state("mock", [*args, "--disaggregation-mode", "prefill"])
    assert role is Role.PREFILL and pd.protocol == "sglang-bootstrap" and pd.bootstrap_port == 8998


def test_sglang_unknown_mode_is_refused_naming_the_choices():
    msg = refused("sglang", ["--disaggregation-mode", "encode"])
    assert "--disaggregation-mode 'encode'" in msg and "null, prefill, decode" in msg


def test_sglang_mode_without_a_value_is_refused():
    assert "--disaggregation-mode needs a value" in refused("sglang", ["--disaggregation-mode"])


@pytest.mark.parametrize("port, needle", [("abc", "not a number"), ("70000", "out of range"), ("-1", "out of range")])
def test_sglang_prefill_bootstrap_port_must_be_a_port(port, needle):
    msg = refused("sglang", ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", port])
    assert "--disaggregation-bootstrap-port" in msg and needle in msg


def test_bootstrap_port_0_only_for_the_mock_which_reports_the_port_it_bound():
    msg = refused("sglang", ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", "0"])
    assert "only with the mock" in msg
    role, pd, _ = state("mock", ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", "0"])
    assert role is Role.PREFILL and pd.bootstrap_port is None  # known once the engine reports it


def test_a_decode_bootstrap_port_is_not_checked_as_the_decode_binds_none():
    assert state("sglang", ["--disaggregation-mode", "decode", "--disaggregation-bootstrap-port", "0"])[0] is Role.DECODE


def test_vllm_flag_on_sglang_is_refused_naming_sglangs():
    msg = refused("sglang", ["--kv-transfer-config", PRODUCER])
    assert "vLLM" in msg and "--disaggregation-mode prefill|decode" in msg
    assert "--disaggregation-mode" in refused("mock", ["--kv-transfer-config", PRODUCER])  # sglang flavour


# --- DP size -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("engine, args, dp", [
    ("sglang", ["--dp", "4", "--enable-dp-attention", "--disaggregation-mode", "decode"], 4),
    ("sglang", ["--dp-size", "2"], 2),
    ("sglang", ["--data-parallel-size=3", "--disaggregation-mode", "prefill"], 3),
    ("vllm", ["-dp", "2", "--kv-transfer-config", PRODUCER], 2),
    ("vllm", ["--data-parallel-size", "4"], 4),
    ("mock", ["--dp-size", "2", "--engine-flavor", "vllm", "--kv-transfer-config", CONSUMER], 2),
])
def test_dp_size_from_the_engines_flags(engine, args, dp):
    assert state(engine, args)[2] == dp


def test_dp_size_must_be_a_positive_number():
    assert "not a number" in refused("sglang", ["--dp", "two"])
    assert "at least 1" in refused("vllm", ["-dp", "0"])


# --- vLLM: --kv-transfer-config ----------------------------------------------------------------------
def test_vllm_without_a_kv_transfer_config_is_aggregated():
    assert state("vllm", ["--model", "/m"]) == (Role.AGGREGATED, None, 1)


def test_vllm_mooncake_producer_is_a_prefill_on_vllms_default_bootstrap_port():
    assert state("vllm", ["--kv-transfer-config", PRODUCER]) == (
        Role.PREFILL, PdParams(protocol="vllm-mooncake", bootstrap_host=HOST, bootstrap_port=8998), 1)


def test_vllm_bootstrap_port_from_its_environment_and_engine_id_from_the_config():
    config = json.dumps({"kv_connector": "MooncakeConnector", "kv_role": "kv_producer", "engine_id": "p1"})
    _, pd, _ = state("vllm", ["--kv-transfer-config", config], env={"VLLM_MOONCAKE_BOOTSTRAP_PORT": "9100"})
    assert (pd.bootstrap_port, pd.engine_id) == (9100, "p1")


def test_vllm_mooncake_consumer_is_a_decode():
    assert state("vllm", ["--kv-transfer-config", CONSUMER]) == (Role.DECODE, PdParams(protocol="vllm-mooncake"), 1)


def test_the_mock_in_its_vllm_flavour_follows_vllm():
    role, pd, _ = state("mock", ["--engine-flavor", "vllm", "--kv-transfer-config", PRODUCER])
    assert role is Role.PREFILL and pd.protocol == "vllm-mooncake"
    assert "SGLang" in refused("mock", ["--engine-flavor", "vllm", "--disaggregation-mode", "prefill"])


def test_kv_both_is_aggregated_unless_the_agent_picks_a_role():
    assert state("vllm", ["--kv-transfer-config", BOTH]) == (Role.AGGREGATED, None, 1)
    assert state("vllm", ["--kv-transfer-config", BOTH], role="prefill") == (
        Role.PREFILL, PdParams(protocol="vllm-mooncake", bootstrap_host=HOST, bootstrap_port=8998), 1)
    assert state("vllm", ["--kv-transfer-config", BOTH], role="decode")[:2] == (
        Role.DECODE, PdParams(protocol="vllm-mooncake"))


@pytest.mark.parametrize("flag", ["--disaggregation-mode", "--disaggregation-bootstrap-port",
                                  "--disaggregation-transfer-backend"])
def test_sglang_flags_on_vllm_are_refused_naming_vllms(flag):
    msg = refused("vllm", [flag, "prefill"])
    assert flag in msg and "--kv-transfer-config" in msg and "kv_producer" in msg


@pytest.mark.parametrize("raw, needle", [
    ("{kv_role: kv_producer}", "not valid JSON"),
    ('["MooncakeConnector"]', "must be a JSON object"),
    ('{"kv_connector": "MooncakeConnector"}', "needs a kv_role"),
    ('{"kv_connector": "MooncakeConnector", "kv_role": "producer"}', "kv_role 'producer' is not one of"),
    ('{"kv_connector": "MooncakeConnector", "kv_role": "kv_producer", "engine_id": 7}', "engine_id"),
    ('{"kv_connector": "MooncakeConnector", "kv_role": "kv_both", "kv_connector_extra_config": []}',
     "kv_connector_extra_config"),
])
def test_unusable_kv_transfer_configs_are_refused(raw, needle):
    msg = refused("vllm", ["--kv-transfer-config", raw])
    assert "--kv-transfer-config" in msg and needle in msg


def test_kv_transfer_config_without_a_value_is_refused():
    assert "needs a JSON object" in refused("vllm", ["--kv-transfer-config"])


def test_a_kv_role_without_a_connector_transfers_nothing():
    assert state("vllm", ["--kv-transfer-config", '{"kv_role": "kv_producer"}'])[0] is Role.AGGREGATED


def test_other_connectors_are_served_aggregated_with_a_note_for_a_producer_or_consumer():
    nixl = plan_pd("vllm", ["--kv-transfer-config", '{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}'],
                   env={})
    assert nixl.role is Role.AGGREGATED and nixl.protocol is None
    assert "MooncakeConnector only" in nixl.notes[0]
    lmcache = plan_pd("vllm", ["--kv-transfer-config", '{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}'],
                      env={})
    assert lmcache.role is Role.AGGREGATED and lmcache.notes == ()


@pytest.mark.parametrize("value, needle", [("abc", "not a number"), ("70000", "out of range"), ("0", "only with the mock")])
def test_vllm_bootstrap_port_env_must_be_a_port(value, needle):
    msg = refused("vllm", ["--kv-transfer-config", PRODUCER], env={"VLLM_MOONCAKE_BOOTSTRAP_PORT": value})
    assert "VLLM_MOONCAKE_BOOTSTRAP_PORT" in msg and needle in msg


def test_the_env_port_matters_only_where_a_bootstrap_server_runs():
    assert state("vllm", ["--kv-transfer-config", CONSUMER], env={"VLLM_MOONCAKE_BOOTSTRAP_PORT": "x"})[0] is Role.DECODE
    _, pd, _ = state("mock", ["--engine-flavor", "vllm", "--kv-transfer-config", PRODUCER],
                     env={"VLLM_MOONCAKE_BOOTSTRAP_PORT": "0"})
    assert pd.bootstrap_port is None  # the mock binds a free port and reports it


def test_an_external_bootstrap_server_is_registered_as_the_bootstrap_address():
    config = {"kv_connector": "MooncakeConnector", "kv_role": "kv_producer",
              "kv_connector_extra_config": {"bootstrap_server_address": "10.9.9.9:7000"}}
    _, pd, _ = state("vllm", ["--kv-transfer-config", json.dumps(config)])
    assert (pd.bootstrap_host, pd.bootstrap_port) == ("10.9.9.9", 7000)
    config["kv_connector_extra_config"]["bootstrap_server_address"] = "10.9.9.9"
    assert "not host:port" in refused("vllm", ["--kv-transfer-config", json.dumps(config)])


def test_vllms_dotted_and_underscore_spellings_are_read_as_vllm_reads_them():
    dotted = ["--kv-transfer-config.kv_connector", "MooncakeConnector", "--kv-transfer-config.kv_role=kv_consumer"]
    assert state("vllm", dotted)[0] is Role.DECODE
    plan = plan_engine("vllm", ["--kv_transfer_config", PRODUCER, "--data_parallel_size", "2"], python="py",
                       free_port=8000, default_model_path="/m")
    assert (plan.pd.role, plan.pd.dp_size) == (Role.PREFILL, 2)
    assert "--kv_transfer_config" in plan.argv  # the engine still gets its arguments verbatim


def test_dotted_keys_replace_a_json_value_as_in_vllm():
    args = ["--kv-transfer-config", PRODUCER, "--kv-transfer-config.kv_connector", "MooncakeConnector",
            "--kv-transfer-config.kv_role", "kv_consumer"]
    assert state("vllm", args)[0] is Role.DECODE
    assert state("mock", ["--engine-flavor", "vllm", *args])[0] is Role.PREFILL  # the mock reads JSON only


# --- the agent's --role ------------------------------------------------------------------------------
def test_role_that_agrees_with_the_engine_flags_is_accepted():
    assert state("sglang", ["--disaggregation-mode", "prefill"], role="prefill")[0] is Role.PREFILL
    assert state("vllm", [], role="aggregated")[0] is Role.AGGREGATED


def test_role_without_the_engine_flag_says_which_flag_to_add():
    assert "add --disaggregation-mode prefill" in refused("sglang", [], role="prefill")
    msg = refused("vllm", [], role="decode")
    assert "add --kv-transfer-config" in msg and "kv_consumer" in msg


def test_role_against_the_engine_flag_says_what_to_change():
    msg = refused("sglang", ["--disaggregation-mode", "prefill"], role="aggregated")
    assert "drop --disaggregation-mode prefill" in msg
    msg = refused("vllm", ["--kv-transfer-config", CONSUMER], role="prefill")
    assert "kv_role kv_consumer" in msg and "kv_producer" in msg


def test_a_wrong_combination_exits_2_before_anything_starts(capsys):
    assert main(["--engine", "vllm", "--nats-url", "nats://127.0.0.1:1", "--", "--disaggregation-mode",
                 "prefill"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("infera-worker-agent: error: --disaggregation-mode is SGLang's flag")
