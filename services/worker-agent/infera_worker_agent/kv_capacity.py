"""The engine's KV cache capacity per DP rank, in tokens: pure rules over what the engine reports.

The routers weigh what placing a prompt on a worker would evict (``policy_kv_aware``): a cache with
room stores new blocks for free, a full one drops reusable prefixes for them. The capacity goes in
the worker record (``kv_capacity_tokens``); None when the engine does not say (the router then
assumes nothing is evicted).

- SGLang and the mock: ``/server_info``'s ``max_total_num_tokens`` (the scheduler's KV pool; with
  DP ranks each rank has a pool of this size).
- vLLM (no ``/server_info``): the ``vllm:cache_config_info`` gauge on ``/metrics``, whose labels are
  the engine's cache configuration: ``kv_cache_size_tokens`` (per DP engine, group-aware; vLLM
  0.32), else ``num_gpu_blocks`` × ``block_size``. The sample of engine 0 is read.
"""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families

CACHE_CONFIG_INFO = "vllm:cache_config_info"


def capacity_tokens(engine: str, server_info: dict[str, Any] | None, metrics_text: str | None) -> int | None:
    if engine == "vllm":
        return _from_cache_config_info(metrics_text) if metrics_text else None
    value = (server_info or {}).get("max_total_num_tokens")
    return value if _positive(value) else None


def _from_cache_config_info(text: str) -> int | None:
    try:
        families = list(text_string_to_metric_families(text))
    except Exception:  # not Prometheus text: nothing known
        return None
    samples = [s for f in families if f.name == CACHE_CONFIG_INFO for s in f.samples]
    samples.sort(key=lambda s: s.labels.get("engine") != "0")  # engine 0 first
    for sample in samples:
        labels = sample.labels
        tokens = _int(labels.get("kv_cache_size_tokens"))
        if tokens is not None:
            return tokens
        blocks, size = _int(labels.get("num_gpu_blocks")), _int(labels.get("block_size"))
        if blocks is not None and size is not None:
            return blocks * size
    return None


def _int(text: str | None) -> int | None:
    if text is None or not text.isdigit():
        return None
    value = int(text)
    return value if value > 0 else None


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
