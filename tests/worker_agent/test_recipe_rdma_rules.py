"""Recipe rules for prefill/decode legs: the ROCm RDMA environment, the PD launch preflight, and the
engine's environment passing through untouched."""

import pytest

from infera_worker_agent.engine_cmd import plan_engine
from infera_common.host.rdma import RdmaPort
from infera_worker_agent.host_probe import HostFacts
from infera_worker_agent.recipe_rdma import pd_preflight_rule, rocm_rdma_env_rule, routable
from infera_worker_agent.recipe_types import RecipeRefusal
from infera_worker_agent.recipes import apply_recipes, engine_env
from tests.worker_agent.recipe_fakes import (
    GOOD_HOST, LAPTOP, SGLANG_DECODE, SGLANG_PREFILL, VLLM_CONSUMER, VLLM_PRODUCER, make_ctx, rdma_host, roce_port,
)


# --- ROCm RDMA environment -----------------------------------------------------------------------
def test_rocm_pd_leg_gets_mooncake_settings_and_the_rail_address_from_the_first_active_port():
    host = rdma_host(roce_port("ionic_0", "192.168.1.5", active=False), roce_port("ionic_1", "192.168.1.11"),
                     roce_port("ionic_2", "192.168.1.21"))
    result = rocm_rdma_env_rule(make_ctx("sglang", SGLANG_PREFILL, host=host))
    assert dict(result.env) == {"MC_GID_INDEX": "1", "MC_DISABLE_HIP_TRANSPORT": "1",
                                "SGLANG_HOST_IP": "192.168.1.11", "MC_TCP_BIND_ADDRESS": "192.168.1.11"}
    assert any("from the RoCE GID of ionic_1/1" in n for n in result.notes)


def test_vllm_pd_leg_exports_vllms_host_ip_name():
    result = rocm_rdma_env_rule(make_ctx("vllm", ["--kv-transfer-config", VLLM_CONSUMER]))
    env = dict(result.env)
    assert env["VLLM_HOST_IP"] == env["MC_TCP_BIND_ADDRESS"] == "192.168.1.11"
    assert "SGLANG_HOST_IP" not in env


def test_rocm_env_sets_only_unset_variables_and_reads_the_gid_index_in_use():
    host = rdma_host(roce_port("ionic_0", "192.168.7.7", index=3))  # the IPv4 GID at index 3
    env = {"MC_GID_INDEX": "3", "MC_DISABLE_HIP_TRANSPORT": "0", "HOST_IP": "10.9.9.9"}
    result = rocm_rdma_env_rule(make_ctx("sglang", SGLANG_DECODE, env=env, host=host))
    # SGLang reads HOST_IP when SGLANG_HOST_IP is unset: the user's choice is kept
    assert dict(result.env) == {"MC_TCP_BIND_ADDRESS": "192.168.7.7"}


def test_rail_address_falls_back_to_the_advertise_host_without_a_roce_ipv4_gid():
    host = rdma_host(roce_port("ionic_0", None))
    env = dict(rocm_rdma_env_rule(make_ctx("sglang", SGLANG_PREFILL, host=host, advertise="10.0.0.11")).env)
    assert env["SGLANG_HOST_IP"] == env["MC_TCP_BIND_ADDRESS"] == "10.0.0.11"


def test_rail_address_follows_the_named_ib_devices():
    args = [*SGLANG_PREFILL, "--disaggregation-ib-device", "ionic_1"]
    env = dict(rocm_rdma_env_rule(make_ctx("sglang", args)).env)
    assert env["SGLANG_HOST_IP"] == "192.168.1.21"


def test_infiniband_gids_are_not_taken_for_an_ip_address():
    ib = RdmaPort("mlx5_0", 1, True, "InfiniBand", roce_port("x", "192.168.1.11").gids)
    env = dict(rocm_rdma_env_rule(make_ctx("sglang", SGLANG_PREFILL, host=rdma_host(ib), advertise="10.0.0.11")).env)
    assert env["SGLANG_HOST_IP"] == "10.0.0.11"


@pytest.mark.parametrize("engine, args, host", [
    ("sglang", SGLANG_PREFILL, rdma_host(roce_port("ionic_0", "192.168.1.11"), rocm=False)),  # not ROCm
    ("sglang", ["--model-path", "/m"], GOOD_HOST),  # aggregated: no KV transfer
    ("mock", ["--disaggregation-mode", "prefill"], GOOD_HOST),
])
def test_no_rdma_environment_off_rocm_or_off_a_real_pd_leg(engine, args, host):
    assert rocm_rdma_env_rule(make_ctx(engine, args, host=host)).env == ()


# --- PD launch preflight -----------------------------------------------------------------------
@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0", "localhost", "::", "[::1]", "127.0.1.1"])
def test_a_pd_worker_advertising_a_loopback_or_wildcard_host_is_refused(host):
    with pytest.raises(RecipeRefusal) as err:
        pd_preflight_rule(make_ctx("sglang", SGLANG_PREFILL, advertise=host))
    assert str(err.value) == (
        "refusing to start this sglang prefill worker: its KV transfer would not run over RDMA between nodes:\n"
        f"  - it would advertise {host}, which a peer on another node cannot reach (the bootstrap and the KV "
        "transfer connect to it); fix: --advertise-host <this node's routable IP>\n"
        "For a single-host or TCP-only test, pass --disaggregation-allow-tcp.\n"
        "For a cold cross-node bootstrap (a first start, while the peer still loads its weights), also export "
        "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT=1800.")


@pytest.mark.parametrize("backend", ["mooncake_tcp", "fake", "ascend"])
def test_a_tcp_transfer_backend_is_refused(backend):
    args = ["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", backend]
    with pytest.raises(RecipeRefusal, match=f"--disaggregation-transfer-backend {backend} does not move KV over "
                                            "RDMA; fix: --disaggregation-transfer-backend mooncake"):
        pd_preflight_rule(make_ctx("sglang", args))


def test_mc_force_tcp_is_refused():
    with pytest.raises(RecipeRefusal, match="MC_FORCE_TCP=1 forces Mooncake onto TCP; fix: unset MC_FORCE_TCP"):
        pd_preflight_rule(make_ctx("sglang", SGLANG_DECODE, env={"MC_FORCE_TCP": "1"}))


def test_a_host_without_active_rdma_ports_is_refused():
    down = rdma_host(roce_port("ionic_0", "192.168.1.11", active=False))
    with pytest.raises(RecipeRefusal, match=r"no RDMA port is active \(ionic_0/1 down\); fix: bring the RDMA links"):
        pd_preflight_rule(make_ctx("sglang", SGLANG_DECODE, host=down))
    with pytest.raises(RecipeRefusal, match="this host has no RDMA device"):
        pd_preflight_rule(make_ctx("sglang", SGLANG_DECODE, host=LAPTOP))


def test_a_named_ib_device_without_an_active_port_is_refused():
    host = rdma_host(roce_port("ionic_0", "192.168.1.11"), roce_port("ionic_1", "192.168.1.21", active=False))
    args = [*SGLANG_DECODE, "--disaggregation-ib-device", "ionic_0,ionic_1"]
    with pytest.raises(RecipeRefusal, match="--disaggregation-ib-device names ionic_1, which has no active port"):
        pd_preflight_rule(make_ctx("sglang", args, host=host))
    per_gpu = [*SGLANG_DECODE, "--disaggregation-ib-device", '{"0": "ionic_0", "1": "ionic_1"}']
    with pytest.raises(RecipeRefusal, match="names ionic_1"):
        pd_preflight_rule(make_ctx("sglang", per_gpu, host=host))


def test_vllm_mooncake_over_tcp_is_refused_without_sglangs_timeout_hint():
    config = '{"kv_connector":"MooncakeConnector","kv_role":"kv_producer",' \
             '"kv_connector_extra_config":{"mooncake_protocol":"tcp"}}'
    with pytest.raises(RecipeRefusal) as err:
        pd_preflight_rule(make_ctx("vllm", ["--kv-transfer-config", config]))
    assert "mooncake_protocol is 'tcp', not rdma" in str(err.value)
    assert "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT" not in str(err.value)


def test_every_problem_is_named_at_once():
    with pytest.raises(RecipeRefusal) as err:
        pd_preflight_rule(make_ctx("vllm", ["--kv-transfer-config", VLLM_PRODUCER], host=LAPTOP, advertise="0.0.0.0"))
    lines = str(err.value).splitlines()
    assert lines[0] == "refusing to start this vllm prefill worker: its KV transfer would not run over RDMA " \
                       "between nodes:"
    assert lines[1].startswith("  - it would advertise 0.0.0.0, which a peer on another node cannot reach")
    assert lines[2].startswith("  - this host has no RDMA device (/sys/class/infiniband is empty); fix:")
    assert lines[3:] == ["For a single-host or TCP-only test, pass --disaggregation-allow-tcp."]


def test_a_routable_rdma_pd_leg_passes():
    for engine, args in (("sglang", SGLANG_PREFILL), ("sglang", SGLANG_DECODE),
                         ("vllm", ["--kv-transfer-config", VLLM_CONSUMER])):
        assert pd_preflight_rule(make_ctx(engine, args)).notes[0].startswith("PD preflight: routable advertise host")


def test_disaggregation_allow_tcp_turns_refusals_into_notes():
    result = pd_preflight_rule(make_ctx("sglang", SGLANG_DECODE, host=LAPTOP, advertise="127.0.0.1", allow_tcp=True))
    assert len(result.notes) == 2 and all(n.startswith("PD preflight skipped (--disaggregation-allow-tcp)")
                                          for n in result.notes)


def test_the_mock_engine_and_aggregated_workers_are_never_refused():
    """The mock's KV transfer is a simulated TCP transfer: `infera up` runs PD on one laptop."""
    for engine, args in (("mock", ["--disaggregation-mode", "prefill"]), ("sglang", ["--model-path", "/m"])):
        assert pd_preflight_rule(make_ctx(engine, args, host=LAPTOP, advertise="127.0.0.1")).notes == ()


def test_routable():
    assert routable("10.0.0.11") and routable("node-12.cluster") and routable("fd00::5")
    assert not any(routable(h) for h in ("127.0.0.1", "localhost", "0.0.0.0", "::", "[::]", "", "*"))


# --- the engine's environment ------------------------------------------------------------------
def test_hip_visible_devices_and_every_engine_variable_pass_through_untouched():
    env = {"HIP_VISIBLE_DEVICES": "4,5,6,7", "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "1800",
           "SGLANG_HOST_IP": "10.1.1.1", "MC_GID_INDEX": "3", "VLLM_USE_V1": "1", "NCCL_IB_HCA": "ionic_0"}
    plan = plan_engine("sglang", SGLANG_PREFILL, python="py", free_port=30000, default_model_path="/m",
                       advertise_host="10.0.0.11", enable_kv_events=False, find_ports=lambda n: 1 / 0, env=env)
    planned = apply_recipes(plan, env=env, host=GOOD_HOST)
    child = engine_env(env, planned)
    assert {k: child[k] for k in env} == env
    assert dict(planned.env_changes) == {"MC_DISABLE_HIP_TRANSPORT": "1", "MC_TCP_BIND_ADDRESS": "192.168.1.11"}
    assert child["MC_TCP_BIND_ADDRESS"] == "192.168.1.11"


def test_no_environment_change_for_the_mock_or_a_non_rocm_host():
    plan = plan_engine("mock", ["--disaggregation-mode", "prefill"], python="py", free_port=30000,
                       default_model_path="/m", enable_kv_events=False, find_ports=lambda n: 1 / 0)
    assert apply_recipes(plan, env={}, host=GOOD_HOST).env_changes == ()
    assert engine_env({"A": "1"}, apply_recipes(plan, env={}, host=HostFacts())) == {"A": "1"}
