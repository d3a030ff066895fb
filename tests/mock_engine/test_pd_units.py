"""The pure parts of disaggregation and DP: flags and environment, request fields, rank choice, the
room table."""

from __future__ import annotations

import asyncio

import pytest

from infera_mock_engine.engine_errors import RequestError
from infera_mock_engine.main import parse_args
from infera_mock_engine.pd_config import DisaggConfig, kv_bytes_per_token
from infera_mock_engine.pd_request import routing
from infera_mock_engine.pd_rooms import RoomTable, TransferFailed
from infera_mock_engine.protocol import ChatCompletionRequest
from infera_mock_engine.ranks import pick_rank

MOONCAKE = '{"kv_connector":"MooncakeConnector","kv_role":"%s"}'


def test_sglang_flags_and_the_timeouts_from_the_environment(model_dir, monkeypatch):
    cfg, _ = parse_args(["--model-path", str(model_dir), "--disaggregation-mode", "prefill", "--dp", "4"])
    d = cfg.disagg
    assert (cfg.dp_size, d.mode, d.bootstrap_port, d.bootstrap_timeout, d.waiting_timeout) == (4, "prefill", 8998, 300, 300)
    assert d.kv_bytes_per_token == 2 * 30 * 3 * 64 * 2  # from the bundled config.json
    monkeypatch.setenv("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", "2")
    monkeypatch.setenv("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", "0.5")
    cfg, _ = parse_args(["--model-path", str(model_dir), "--disaggregation-mode", "decode",
                         "--disaggregation-bootstrap-port", "9000", "--kv-bytes-per-token", "1024",
                         "--kv-transfer-bandwidth", "1e9"])
    d = cfg.disagg
    assert (d.mode, d.bootstrap_port, d.bootstrap_timeout, d.waiting_timeout) == ("decode", 9000, 2, 0.5)
    assert (d.kv_bytes_per_token, d.kv_transfer_bandwidth) == (1024, 1e9)
    assert not parse_args(["--model-path", str(model_dir)])[0].disagg.enabled


def test_vllm_kv_transfer_config_sets_the_role(model_dir, monkeypatch):
    monkeypatch.setenv("VLLM_MOONCAKE_BOOTSTRAP_PORT", "9100")
    base = ["serve", str(model_dir), "--engine-flavor", "vllm", "--data-parallel-size", "2"]
    cfg, _ = parse_args([*base, "--kv-transfer-config", MOONCAKE % "kv_producer"])
    d = cfg.disagg
    assert (d.mode, d.protocol, d.bootstrap_port, d.abort_request_timeout, d.kv_load_failure_policy) == (
        "prefill", "vllm", 9100, 480, "fail")
    assert d.rank_engine_id(1, 2) == f"{d.engine_id}_dp1" and d.rank_engine_id(0, 1) == d.engine_id
    assert parse_args([*base, "--kv-transfer-config", MOONCAKE % "kv_consumer"])[0].disagg.mode == "decode"
    both = parse_args([*base, "--kv-transfer-config",
                       '{"kv_connector":"MooncakeConnector","kv_role":"kv_both","engine_id":"p0"}'])[0].disagg
    assert both.serves_prefill and both.serves_decode and both.engine_id == "p0"


@pytest.mark.parametrize("flags, env, fragment", [
    (["--engine-flavor", "vllm", "--disaggregation-mode", "prefill"], {}, "is an SGLang flag"),
    (["--kv-transfer-config", MOONCAKE % "kv_producer"], {}, "is a vLLM flag"),
    (["--engine-flavor", "vllm", "--kv-transfer-config", '{"kv_connector":"NixlConnector","kv_role":"kv_producer"}'],
     {}, "MooncakeConnector handshake only"),
    (["--engine-flavor", "vllm", "--kv-transfer-config", '{"kv_connector":"MooncakeConnector"}'], {}, "kv_role is required"),
    (["--engine-flavor", "vllm", "--kv-transfer-config", '{"kv_role":"kv_producer","bogus":1}'], {}, "unknown key"),
    (["--engine-flavor", "vllm", "--kv-transfer-config", "{"], {}, "not valid JSON"),
    (["--disaggregation-mode", "both"], {}, "invalid choice"),
    (["--disaggregation-mode", "prefill"], {"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "soon"},
     "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT='soon'"),
    (["--dp-size", "0"], {}, "positive integer"),
])
def test_unusable_disaggregation_settings_exit_2_naming_the_problem(model_dir, monkeypatch, capsys, flags, env,
                                                                    fragment):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as exc:
        parse_args(["--model-path", str(model_dir), *flags])
    assert exc.value.code == 2 and fragment in capsys.readouterr().err


def test_kv_bytes_per_token_follows_the_model_shape():
    assert kv_bytes_per_token({"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                               "hidden_size": 4096}) == 131072  # Llama-3-8B in bf16: 128 KiB a token
    assert kv_bytes_per_token({"num_hidden_layers": 2, "head_dim": 64, "num_attention_heads": 4}) == 2048
    assert kv_bytes_per_token({}) == 16384


def _chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **fields})


def test_sglang_routing_of_a_request():
    prefill, decode = DisaggConfig(mode="prefill"), DisaggConfig(mode="decode")
    r = routing(_chat(bootstrap_room=5, routed_dp_rank=1), {}, "sglang", prefill)
    assert (r.dp_rank, r.pd.role, r.pd.room) == (1, "prefill", 5)
    r = routing(_chat(bootstrap_host="p", bootstrap_room=5, disagg_prefill_dp_rank=0, data_parallel_rank=1), {},
                "sglang", decode)
    assert (r.dp_rank, r.dp_rank_field, r.pd.bootstrap_port, r.pd.prefill_dp_rank) == (1, "data_parallel_rank", 8998, 0)
    assert routing(_chat(bootstrap_room=5), {}, "sglang", DisaggConfig()).pd is None  # aggregated: ignored
    with pytest.raises(RequestError, match="bootstrap_host"):
        routing(_chat(bootstrap_room=5), {}, "sglang", decode)
    with pytest.raises(ValueError):
        _chat(bootstrap_room=2**63)


def test_vllm_routing_of_a_request():
    both = DisaggConfig(mode="both", protocol="vllm", engine_id="e")
    params = {"do_remote_prefill": True, "remote_bootstrap_addr": "h:1", "remote_engine_id": "e_dp1",
              "transfer_id": "t"}
    r = routing(_chat(kv_transfer_params=params), {"X-data-parallel-rank": "1"}, "vllm", both)
    assert (r.dp_rank, r.pd.role, r.pd.key, r.pd.remote_engine_id) == (1, "decode", "t", "e_dp1")
    r = routing(_chat(kv_transfer_params={"do_remote_decode": True, "transfer_id": "t"}), {}, "vllm", both)
    assert r.pd.role == "prefill" and r.dp_rank is None
    assert routing(_chat(kv_transfer_params=params), {}, "vllm", DisaggConfig(protocol="vllm")).pd is None
    with pytest.raises(RequestError, match="remote_engine_id"):
        routing(_chat(kv_transfer_params={"do_remote_prefill": True, "transfer_id": "t"}), {}, "vllm", both)
    with pytest.raises(RequestError, match="not an integer"):
        routing(_chat(), {"X-data-parallel-rank": "one"}, "vllm", both)


def test_pick_rank():
    assert pick_rank(4, pinned=3, room=1) == 3
    assert pick_rank(4, room=2**62 + 1) == 1
    assert [pick_rank(3, round_robin=i) for i in range(4)] == [0, 1, 2, 0]
    # vLLM's balancer: the least waiting × 4 + running, ties to the lowest rank, whatever the turn
    assert [pick_rank(3, round_robin=i, queues=[(0, 0)] * 3) for i in range(3)] == [0, 0, 0]
    assert pick_rank(3, queues=[(1, 0), (0, 3), (0, 4)]) == 1 and pick_rank(2, queues=[(0, 2), (0, 1)]) == 1
    with pytest.raises(RequestError, match="dp_size=2"):
        pick_rank(2, pinned=2)


async def test_rooms_meet_in_either_order_and_end_once():
    rooms = RoomTable(tombstone_ttl=60)
    a = rooms.attach((0, 1))  # the decode first
    assert rooms.open((0, 1)) is a and a.attached.is_set() and a.opened
    b = rooms.open((1, 1))  # same room id on another DP rank: another room
    assert b is not a and not b.attached.is_set()
    rooms.finish(a)
    assert a.outcome.result() is None and len(rooms) == 1
    with pytest.raises(TransferFailed, match="already in use"):
        rooms.open((1, 1))


async def test_a_failed_room_fails_the_late_side_at_once_until_its_tombstone_expires():
    now = [0.0]
    failures = []
    rooms = RoomTable(tombstone_ttl=10, clock=lambda: now[0], on_fail=failures.append)
    room = rooms.open((0, 7))
    rooms.fail(room, TransferFailed("aborted", "aborted"))
    rooms.fail(room, TransferFailed("again", "x"))  # a room ends once
    assert room.outcome.result().kind == "aborted" and [f.kind for f in failures] == ["aborted"]
    with pytest.raises(TransferFailed, match="aborted"):
        rooms.attach((0, 7))
    now[0] = 11
    assert rooms.attach((0, 7)).attached.is_set()


async def test_fail_after_ends_a_room_nobody_finished():
    rooms = RoomTable(tombstone_ttl=10)
    room = rooms.open((0, "t"))
    rooms.fail_after(room, 0.01, TransferFailed("expired", "expired"))
    assert (await asyncio.wait_for(room.outcome, 5)).kind == "expired"
    kept = rooms.open((0, "u"))
    rooms.fail_after(kept, 0.01, TransferFailed("expired", "expired"))
    rooms.finish(kept)
    await asyncio.sleep(0.03)
    assert kept.outcome.result() is None
