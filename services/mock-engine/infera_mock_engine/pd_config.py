"""Prefill/decode disaggregation settings (pure: no I/O).

SGLang flavour: `--disaggregation-mode null|prefill|decode`, `--disaggregation-bootstrap-port` (8998),
`--disaggregation-transfer-backend`; timeouts from SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT (the
prefill waits this long for its decode to connect, 300 s) and SGLANG_DISAGGREGATION_WAITING_TIMEOUT
(the decode waits this long for the KV, 300 s) — the defaults of SGLang's `environ.py`.

vLLM flavour: `--kv-transfer-config '{"kv_connector": "MooncakeConnector", "kv_role":
"kv_producer|kv_consumer|kv_both", "engine_id": ..., "kv_load_failure_policy": "fail|recompute"}'`;
the bootstrap port comes from VLLM_MOONCAKE_BOOTSTRAP_PORT (8998) and the time a finished prefill
keeps its KV for the decode to pull from VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT (480 s), as in vLLM.

Mock only: `--kv-bytes-per-token` (bytes moved per prompt token; default from config.json:
2 × layers × KV heads × head dim × 2 bytes) and `--kv-transfer-bandwidth` (bytes/s cap).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SGLANG_MODES = ("null", "prefill", "decode")
TRANSFER_BACKENDS = ("mooncake", "nixl", "ascend", "mori", "fake")
KV_ROLES = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}
DEFAULT_BOOTSTRAP_PORT = 8998
FALLBACK_KV_BYTES_PER_TOKEN = 16384
# vLLM's KVTransferConfig fields (a dataclass: any other key is an error).
_VLLM_KEYS = frozenset({
    "kv_connector", "engine_id", "kv_buffer_device", "kv_buffer_size", "kv_role", "kv_rank",
    "kv_parallel_size", "kv_ip", "kv_port", "kv_connector_extra_config", "kv_connector_module_path",
    "enable_permute_local_kv", "kv_load_failure_policy",
})
_ENV_DEFAULTS = {
    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": 300.0,
    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": 300.0,
    "VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT": 480.0,
}


class DisaggConfigError(ValueError):
    """Unusable disaggregation settings (the message names the flag or variable)."""


@dataclass(frozen=True)
class DisaggConfig:
    mode: str = "null"  # null | prefill | decode | both (vLLM kv_both)
    protocol: str = "sglang"  # sglang: bootstrap rooms; vllm: Mooncake transfer ids
    bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT
    transfer_backend: str = "mooncake"
    kv_bytes_per_token: int = FALLBACK_KV_BYTES_PER_TOKEN
    kv_transfer_bandwidth: float | None = None  # bytes/s; None = as fast as the socket goes
    bootstrap_timeout: float = 300.0
    waiting_timeout: float = 300.0
    abort_request_timeout: float = 480.0
    kv_transfer_config: dict[str, Any] | None = None  # vLLM, as given (engine_id resolved)
    engine_id: str | None = None  # vLLM; DP rank r answers as f"{engine_id}_dp{r}" when dp > 1
    kv_load_failure_policy: str = "fail"  # vLLM: fail | recompute

    @property
    def enabled(self) -> bool:
        return self.mode != "null"

    @property
    def serves_prefill(self) -> bool:
        """Runs the bootstrap server and answers prefill requests."""
        return self.mode in ("prefill", "both")

    @property
    def serves_decode(self) -> bool:
        return self.mode in ("decode", "both")

    @property
    def decode_wait(self) -> float:
        """How long a decode request waits for its KV."""
        return self.waiting_timeout if self.protocol == "sglang" else self.abort_request_timeout

    def rank_engine_id(self, dp_rank: int, dp_size: int) -> str | None:
        if self.engine_id is None:
            return None
        return f"{self.engine_id}_dp{dp_rank}" if dp_size > 1 else self.engine_id


def kv_bytes_per_token(model_config: Mapping[str, Any]) -> int:
    """KV cache bytes of one token: K and V × layers × KV heads × head dim × 2 bytes (bf16)."""
    try:
        layers = int(model_config["num_hidden_layers"])
        heads = int(model_config.get("num_attention_heads") or 0)
        kv_heads = int(model_config.get("num_key_value_heads") or heads)
        head_dim = int(model_config.get("head_dim") or (int(model_config["hidden_size"]) // heads))
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return FALLBACK_KV_BYTES_PER_TOKEN
    value = 2 * layers * kv_heads * head_dim * 2
    return value if value > 0 else FALLBACK_KV_BYTES_PER_TOKEN


def env_seconds(env: Mapping[str, str], name: str) -> float:
    text = env.get(name)
    if text is None or text == "":
        return _ENV_DEFAULTS[name]
    try:
        value = float(text)
    except ValueError:
        raise DisaggConfigError(f"{name}={text!r} is not a number of seconds") from None
    if not value > 0:
        raise DisaggConfigError(f"{name}={text!r} must be > 0 seconds")
    return value


def env_port(env: Mapping[str, str], name: str) -> int:
    text = env.get(name)
    if text is None or text == "":
        return DEFAULT_BOOTSTRAP_PORT
    try:
        value = int(text)
    except ValueError:
        raise DisaggConfigError(f"{name}={text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise DisaggConfigError(f"{name}={text!r} must be within 0..65535")
    return value


def parse_kv_transfer_config(text: str) -> dict[str, Any]:
    """vLLM `--kv-transfer-config` JSON, validated as vLLM does, for the Mooncake connector only."""
    try:
        data = json.loads(text)
    except ValueError as e:
        raise DisaggConfigError(f"--kv-transfer-config is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise DisaggConfigError("--kv-transfer-config must be a JSON object")
    unknown = sorted(set(data) - _VLLM_KEYS)
    if unknown:
        raise DisaggConfigError(f"--kv-transfer-config: unknown key(s) {', '.join(unknown)} "
                                f"(known: {', '.join(sorted(_VLLM_KEYS))})")
    connector = data.get("kv_connector")
    role = data.get("kv_role")
    if connector is not None and role is None:
        raise DisaggConfigError("--kv-transfer-config: kv_role is required when kv_connector is set "
                                "(kv_producer, kv_consumer or kv_both)")
    if role is not None and role not in KV_ROLES:
        raise DisaggConfigError(f"--kv-transfer-config: unsupported kv_role {role!r}; "
                                f"supported: {', '.join(KV_ROLES)}")
    if role is not None and connector != "MooncakeConnector":
        raise DisaggConfigError(f"--kv-transfer-config: the mock engine simulates the MooncakeConnector "
                                f"handshake only, got kv_connector {connector!r}")
    policy = data.get("kv_load_failure_policy", "fail")
    if policy not in ("fail", "recompute"):
        raise DisaggConfigError(f"--kv-transfer-config: kv_load_failure_policy must be 'fail' or "
                                f"'recompute', got {policy!r}")
    engine_id = data.get("engine_id")
    if engine_id is not None and (not isinstance(engine_id, str) or not engine_id):
        raise DisaggConfigError("--kv-transfer-config: engine_id must be a non-empty string")
    extra = data.get("kv_connector_extra_config")
    if extra is not None and not isinstance(extra, dict):
        raise DisaggConfigError("--kv-transfer-config: kv_connector_extra_config must be an object")
    return data


def build_disagg_config(
    flavor: str,
    *,
    mode: str | None,
    bootstrap_port: int | None,
    transfer_backend: str | None,
    kv_transfer_config: str | None,
    kv_bytes: int | None,
    bandwidth: float | None,
    model_config: Mapping[str, Any],
    env: Mapping[str, str],
) -> DisaggConfig:
    """The disaggregation settings of a command line; raises DisaggConfigError naming the problem."""
    per_token = kv_bytes if kv_bytes is not None else kv_bytes_per_token(model_config)
    common: dict[str, Any] = {"kv_bytes_per_token": per_token, "kv_transfer_bandwidth": bandwidth}
    if flavor == "vllm":
        for flag, value in (("--disaggregation-mode", mode), ("--disaggregation-bootstrap-port", bootstrap_port),
                            ("--disaggregation-transfer-backend", transfer_backend)):
            if value is not None:
                raise DisaggConfigError(f"{flag} is an SGLang flag; the vllm flavour takes --kv-transfer-config "
                                        "'{\"kv_connector\":\"MooncakeConnector\",\"kv_role\":\"kv_producer\"}' "
                                        "and the bootstrap port from VLLM_MOONCAKE_BOOTSTRAP_PORT")
        if kv_transfer_config is None:
            return DisaggConfig(protocol="vllm", **common)
        data = parse_kv_transfer_config(kv_transfer_config)
        if data.get("kv_role") is None:
            return DisaggConfig(protocol="vllm", kv_transfer_config=data, **common)
        data = dict(data)
        data.setdefault("engine_id", str(uuid.uuid4()))
        return DisaggConfig(
            mode=KV_ROLES[data["kv_role"]], protocol="vllm",
            bootstrap_port=env_port(env, "VLLM_MOONCAKE_BOOTSTRAP_PORT"),
            abort_request_timeout=env_seconds(env, "VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT"),
            kv_transfer_config=data, engine_id=data["engine_id"],
            kv_load_failure_policy=data.get("kv_load_failure_policy", "fail"), **common,
        )
    if kv_transfer_config is not None:
        raise DisaggConfigError("--kv-transfer-config is a vLLM flag; the sglang flavour takes "
                                "--disaggregation-mode prefill|decode and --disaggregation-bootstrap-port")
    return DisaggConfig(
        mode=mode or "null", protocol="sglang",
        bootstrap_port=DEFAULT_BOOTSTRAP_PORT if bootstrap_port is None else bootstrap_port,
        transfer_backend=transfer_backend or "mooncake",
        bootstrap_timeout=env_seconds(env, "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"),
        waiting_timeout=env_seconds(env, "SGLANG_DISAGGREGATION_WAITING_TIMEOUT"),
        **common,
    )
