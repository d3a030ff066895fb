"""The resolved engine arguments (what /server_info reports) and the model's config.json."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from infera_mock_engine.kv_events_config import KvEventsConfig
from infera_mock_engine.lora import LoraModule
from infera_mock_engine.pd_config import DisaggConfig

FLAVORS = ("sglang", "vllm")
DEFAULT_PORTS = {"sglang": 30000, "vllm": 8000}


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    tokenizer_path: str
    served_model_names: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 30000
    engine_flavor: str = "sglang"
    speedup: float = 1.0
    max_running_requests: int = 256
    max_num_batched_tokens: int = 8192
    disable_overlap_schedule: bool = False  # SGLang's flag: host time then lengthens every step
    num_kv_blocks: int = 16384
    page_size: int = 64
    context_length: int = 8192
    startup_delay: float = 0.0
    enable_metrics: bool = False
    mock_output_len: int = 128
    kv_events: KvEventsConfig | None = None  # --kv-events-config; None = not given
    kv_events_ignored: tuple[str, ...] = ()  # keys the flavour's engine ignores (warned about at start)
    kv_hash_seed: str | None = None  # seeds the engine's block hashes (PYTHONHASHSEED, as vLLM); None = random
    dp_size: int = 1  # data-parallel ranks, each with its own scheduler and KV cache
    hang_ranks: tuple[int, ...] | None = None  # the ranks a simulated hang stops (None: all)
    disagg: DisaggConfig = field(default_factory=DisaggConfig)  # prefill/decode role (pd_config.py)
    ignored_args: tuple[str, ...] = ()
    model_config: dict[str, Any] = field(default_factory=dict, compare=False)
    api_key: str | None = field(default=None, repr=False)  # --api-key (vLLM: or VLLM_API_KEY): auth.py
    enable_lora: bool = False
    lora_modules: tuple[LoraModule, ...] = ()  # the LoRA adapters of the command line (lora.py)

    @property
    def served_model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def publishes_kv_events(self) -> bool:
        return self.kv_events is not None and self.kv_events.publishes

    @property
    def max_total_tokens(self) -> int:
        return self.num_kv_blocks * self.page_size

    def public(self) -> dict[str, Any]:
        """The resolved arguments, with the names both engines use for them."""
        d = asdict(self)
        d.pop("model_config")
        d.pop("kv_hash_seed")
        d.pop("api_key")  # a secret: /server_info says only whether one is set
        d["api_key_set"] = self.api_key is not None
        kv = d.pop("kv_events")
        if kv is not None:
            kv.pop("flavor")
        d["kv_events_config"] = kv
        d["disaggregation"] = d.pop("disagg")
        d["disaggregation_mode"] = self.disagg.mode
        d["disaggregation_bootstrap_port"] = self.disagg.bootstrap_port
        d["disaggregation_transfer_backend"] = self.disagg.transfer_backend
        d["kv_transfer_config"] = self.disagg.kv_transfer_config
        d["data_parallel_size"] = self.dp_size
        d["kv_events_ignored"] = list(self.kv_events_ignored)
        d["served_model_name"] = self.served_model_name
        d["max_total_num_tokens"] = self.max_total_tokens
        d["max_total_tokens"] = self.max_total_tokens
        d["num_gpu_blocks"] = self.num_kv_blocks
        d["block_size"] = self.page_size
        d["chunked_prefill_size"] = self.max_num_batched_tokens
        d["max_num_seqs"] = self.max_running_requests
        d["max_model_len"] = self.context_length
        d["ignored_args"] = list(self.ignored_args)
        d["served_model_names"] = list(self.served_model_names)
        return d


def read_model_config(model_dir: Path) -> dict[str, Any]:
    """config.json of the model directory ({} when absent or unreadable)."""
    f = model_dir / "config.json"
    try:
        return json.loads(f.read_text())
    except (OSError, ValueError):
        return {}


def default_context_length(model_config: dict[str, Any], tokenizer_dir: Path) -> int:
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = model_config.get(key)
        if isinstance(value, int) and value > 0:
            return value
    try:
        value = json.loads((tokenizer_dir / "tokenizer_config.json").read_text()).get("model_max_length")
        if isinstance(value, int) and 0 < value < 10**8:
            return value
    except (OSError, ValueError):
        pass
    return 4096
