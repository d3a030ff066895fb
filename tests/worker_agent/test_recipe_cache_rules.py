"""Recipe rules for the engine's KV cache: KV events, decode radix, HiCache on decode, KV cache dtype."""

import json

import pytest

from infera_worker_agent.engine_cmd import flag_value, plan_engine
from infera_worker_agent.recipe_cache import (
    decode_radix_rule, hicache_decode_rule, kv_cache_dtype_rule, release_tuple,
)
from infera_worker_agent.recipe_types import RecipeRefusal
from infera_worker_agent.recipes import apply_recipes
from tests.worker_agent.recipe_fakes import GOOD_HOST, SGLANG_DECODE, SGLANG_PREFILL, make_ctx, rdma_host, roce_port

RADIX = "--disaggregation-decode-enable-radix-cache"
HICACHE = "--enable-hierarchical-cache"
SPEC_ENV = {"SGLANG_EXPERIMENTAL_DECODE_RADIX_SPEC": "1"}


# --- KV events (kv_config, planned by plan_engine) ---------------------------------------------
def test_kv_events_are_on_by_default_on_a_contiguous_port_block_per_dp_rank():
    asked = []

    def find_ports(n):
        asked.append(n)
        return 21000 if len(asked) == 1 else 22000

    plan = plan_engine("sglang", ["--model-path", "/m", "--dp", "8", "--enable-dp-attention"], python="py",
                       free_port=30000, default_model_path="/m", enable_kv_events=True, find_ports=find_ports)
    config = json.loads(flag_value(plan.argv, "--kv-events-config"))
    assert asked == [8, 8]  # one block of 8 ports for the publishers, one for the replay sockets
    assert (config["publisher"], config["endpoint"], config["replay_endpoint"]) == (
        "zmq", "tcp://*:21000", "tcp://*:22000")
    assert [s.endpoint for s in plan.kv_events.sources] == [f"tcp://*:{21000 + r}" for r in range(8)]


def test_no_enable_kv_events_adds_no_kv_events_config():
    plan = plan_engine("sglang", ["--model-path", "/m"], python="py", free_port=30000, default_model_path="/m",
                       enable_kv_events=False, find_ports=lambda n: 1 / 0)
    assert "--kv-events-config" not in plan.argv and not plan.kv_events.enabled


# --- decode radix --------------------------------------------------------------------------------
def test_mooncake_decode_with_kv_events_gets_the_decode_radix_flag():
    assert decode_radix_rule(make_ctx("sglang", SGLANG_DECODE)).args == (RADIX,)
    no_backend = ["--model-path", "/m", "--disaggregation-mode", "decode"]  # SGLang's default backend: mooncake
    assert decode_radix_rule(make_ctx("sglang", no_backend)).args == (RADIX,)


@pytest.mark.parametrize("args, kv_events, why", [
    (SGLANG_PREFILL, True, None),
    (["--model-path", "/m"], True, None),  # aggregated
    (SGLANG_DECODE, False, "KV events are off"),
    (["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "nixl"], True, "nixl, not mooncake"),
    ([*SGLANG_DECODE, "--disable-radix-cache"], True, "--disable-radix-cache is given"),
    ([*SGLANG_DECODE, "--enable-hisparse"], True, "--enable-hisparse"),
])
def test_decode_radix_is_not_appended_outside_its_conditions(args, kv_events, why):
    result = decode_radix_rule(make_ctx("sglang", args, kv_events=kv_events))
    assert result.args == ()
    if why:
        assert why in result.notes[0]


def test_decode_radix_given_by_the_user_is_not_duplicated():
    plan = plan_engine("sglang", [*SGLANG_DECODE, RADIX], python="py", free_port=30000, default_model_path="/m",
                       enable_kv_events=True, find_ports=lambda n: 20000, advertise_host="10.0.0.11")
    assert apply_recipes(plan, env={}, host=GOOD_HOST).argv.count(RADIX) == 1


def test_vllm_and_mock_decodes_get_no_sglang_radix_flag():
    consumer = '{"kv_connector":"MooncakeConnector","kv_role":"kv_consumer"}'
    assert decode_radix_rule(make_ctx("vllm", ["--kv-transfer-config", consumer])).args == ()
    assert decode_radix_rule(make_ctx("mock", ["--disaggregation-mode", "decode"])).args == ()


@pytest.mark.parametrize("spec, env, appended", [
    (["--speculative-algorithm", "EAGLE", "--speculative-eagle-topk", "1"], {}, False),  # no opt-in: old behaviour
    (["--speculative-algorithm", "EAGLE", "--speculative-eagle-topk", "1"], SPEC_ENV, True),
    (["--speculative-algorithm", "NEXTN", "--speculative-eagle-topk", "1"], SPEC_ENV, True),
    (["--speculative-algorithm", "nextn", "--speculative-eagle-topk=1"], SPEC_ENV, True),
    (["--speculative-algorithm", "EAGLE3", "--speculative-eagle-topk", "1"], SPEC_ENV, False),
    (["--speculative-algorithm", "EAGLE", "--speculative-eagle-topk", "4"], SPEC_ENV, False),
    (["--speculative-algorithm", "EAGLE"], SPEC_ENV, False),  # SGLang would pick the top-k itself
    (["--speculative-algorithm", "EAGLE", "--speculative-eagle-topk", "1"],
     {"SGLANG_EXPERIMENTAL_DECODE_RADIX_SPEC": "true"}, False),
])
def test_speculative_decode_gets_the_radix_flag_only_with_the_opt_in_eagle_nextn_top_k_1(spec, env, appended):
    result = decode_radix_rule(make_ctx("sglang", [*SGLANG_DECODE, *spec], env=env))
    assert (result.args == (RADIX,)) is appended
    if not appended:
        assert "speculative decoding" in result.notes[0] and "chunk cache" in result.notes[0]


# --- HiCache on decode -------------------------------------------------------------------------
def test_decode_hicache_implies_the_radix_flag_even_with_kv_events_off():
    plan = plan_engine("sglang", [*SGLANG_DECODE, HICACHE, "--hicache-ratio", "1.5"], python="py", free_port=30000,
                       default_model_path="/m", enable_kv_events=False, find_ports=lambda n: 1 / 0,
                       advertise_host="10.0.0.11")
    out = apply_recipes(plan, env={}, host=GOOD_HOST)
    assert out.argv.count(RADIX) == 1
    assert "--kv-events-config" not in out.argv and not out.kv_events.enabled  # KV events stay off
    assert any("its prerequisite" in n and "stay off" in n for n in out.notes)


def test_decode_hicache_keeps_an_explicit_radix_flag_once():
    result = hicache_decode_rule(make_ctx("sglang", [*SGLANG_DECODE, RADIX, HICACHE]))
    assert result.args == ()
    plan = plan_engine("sglang", [*SGLANG_DECODE, RADIX, HICACHE], python="py", free_port=30000,
                       default_model_path="/m", enable_kv_events=True, find_ports=lambda n: 20000,
                       advertise_host="10.0.0.11")
    assert apply_recipes(plan, env={}, host=GOOD_HOST).argv.count(RADIX) == 1


def test_decode_hicache_with_disable_radix_cache_is_refused():
    with pytest.raises(RecipeRefusal) as err:
        hicache_decode_rule(make_ctx("sglang", [*SGLANG_DECODE, HICACHE, "--disable-radix-cache"]))
    assert str(err.value) == (
        "--enable-hierarchical-cache on a decode needs the decode radix cache "
        "(--disaggregation-decode-enable-radix-cache), and --disable-radix-cache turns the radix cache off: drop "
        "--disable-radix-cache, or drop --enable-hierarchical-cache from the decode leg")


@pytest.mark.parametrize("version", ["0.5.18", "0.5.18.post2", "0.4.10"])
def test_decode_hicache_on_an_sglang_older_than_0_5_19_is_refused_saying_why(version):
    with pytest.raises(RecipeRefusal) as err:
        hicache_decode_rule(make_ctx("sglang", [*SGLANG_DECODE, HICACHE], host=rdma_host(sglang=version)))
    message = str(err.value)
    assert f"needs SGLang >= 0.5.19, and SGLang {version} is installed" in message
    assert "lack the storage-hit methods the decode HiCache path calls and crash on the first request" in message


@pytest.mark.parametrize("version", ["0.5.19", "0.5.19.post1", "0.5.19rc0", "0.6.0", "1.0"])
def test_decode_hicache_on_sglang_0_5_19_or_newer_is_accepted(version):
    result = hicache_decode_rule(make_ctx("sglang", [*SGLANG_DECODE, HICACHE], host=rdma_host(sglang=version)))
    assert result.args == (RADIX,)


def test_decode_hicache_without_sglang_installed_is_accepted_with_a_note():
    result = hicache_decode_rule(make_ctx("sglang", [*SGLANG_DECODE, HICACHE], host=rdma_host(sglang=None)))
    assert result.args == (RADIX,)
    assert "not installed" in result.notes[0] and "0.5.19" in result.notes[0]


def test_decode_hicache_with_speculative_decoding_needs_the_opt_in():
    spec = ["--speculative-algorithm", "EAGLE", "--speculative-eagle-topk", "1"]
    with pytest.raises(RecipeRefusal, match="SGLANG_EXPERIMENTAL_DECODE_RADIX_SPEC=1 is not set"):
        hicache_decode_rule(make_ctx("sglang", [*SGLANG_DECODE, HICACHE, *spec]))
    assert hicache_decode_rule(make_ctx("sglang", [*SGLANG_DECODE, HICACHE, *spec], env=SPEC_ENV)).args == (RADIX,)


def test_hicache_on_a_prefill_or_aggregated_worker_is_left_alone():
    assert hicache_decode_rule(make_ctx("sglang", [*SGLANG_PREFILL, HICACHE, "--disable-radix-cache"])).args == ()
    assert hicache_decode_rule(make_ctx("sglang", ["--model-path", "/m", HICACHE],
                                        host=rdma_host(sglang="0.5.10"))).args == ()


def test_release_tuple_reads_release_numbers():
    assert release_tuple("0.5.19.post1") == (0, 5, 19)
    assert release_tuple("v1.0") == (1, 0, 0)
    assert release_tuple("dev") is None


# --- KV cache dtype ------------------------------------------------------------------------------
@pytest.mark.parametrize("engine, args", [("sglang", ["--model-path", "/m"]), ("vllm", ["--model", "/m"])])
def test_kv_cache_dtype_is_fp8_e4m3_by_default(engine, args):
    assert kv_cache_dtype_rule(make_ctx(engine, args)).args == ("--kv-cache-dtype", "fp8_e4m3")


@pytest.mark.parametrize("engine, given", [("sglang", ["--kv-cache-dtype", "auto"]),
                                           ("sglang", ["--kv-cache-dtype=bf16"]),
                                           ("vllm", ["--kv_cache_dtype", "auto"])])
def test_a_kv_cache_dtype_the_user_sets_is_kept(engine, given):
    assert kv_cache_dtype_rule(make_ctx(engine, given)).args == ()


def test_the_mock_engine_gets_no_kv_cache_dtype():
    assert kv_cache_dtype_rule(make_ctx("mock", [])).args == ()


def test_rules_append_after_the_users_arguments_in_order():
    user = [*SGLANG_DECODE, "--tp", "8", HICACHE]
    plan = plan_engine("sglang", user, python="py", free_port=30000, default_model_path="/m",
                       enable_kv_events=False, find_ports=lambda n: 1 / 0, advertise_host="10.0.0.11")
    out = apply_recipes(plan, env={}, host=rdma_host(roce_port("ionic_0", "192.168.1.11")))
    assert list(out.argv[3:3 + len(user)]) == user
    assert list(out.argv[-3:]) == [RADIX, "--kv-cache-dtype", "fp8_e4m3"]
