"""Prometheus metrics under each engine's own names, read from the scheduler at scrape time.

sglang: sglang:num_running_reqs, sglang:num_queue_reqs, sglang:token_usage, sglang:num_used_tokens,
        sglang:cache_hit_rate, sglang:max_total_num_tokens, sglang:prompt_tokens_total,
        sglang:generation_tokens_total, sglang:cached_tokens_total, sglang:num_requests_total
vllm:   vllm:num_requests_running, vllm:num_requests_waiting, vllm:kv_cache_usage_perc,
        vllm:gpu_cache_usage_perc (older name), vllm:prompt_tokens_total, vllm:generation_tokens_total,
        vllm:prefix_cache_queries_total, vllm:prefix_cache_hits_total, vllm:num_preemptions_total,
        vllm:request_success_total{finished_reason}, vllm:cache_config_info (an info gauge, 1, one
        sample per DP rank labelled engine=<rank>, whose labels carry the cache configuration:
        block_size, num_gpu_blocks and kv_cache_size_tokens, as vLLM 0.32 writes them)
Every sample is labelled model_name (vLLM also engine="0", as vLLM V1 does). Usage gauges are
fractions 0..1 in both engines. With DP ranks the samples are sums over the ranks (usage: used over
total blocks of all ranks).

A disaggregated engine adds SGLang's PD gauges and counters (sglang flavour:
sglang:num_prefill_prealloc_queue_reqs, sglang:num_prefill_bootstrap_queue_reqs,
sglang:num_prefill_inflight_queue_reqs, sglang:num_decode_prealloc_queue_reqs,
sglang:num_decode_transfer_queue_reqs, sglang:num_bootstrap_failed_reqs_total,
sglang:num_transfer_failed_reqs_total) and, in both flavours, the mock's own transfer counters:
mock:kv_transfer_sent_bytes_total, mock:kv_transfer_received_bytes_total,
mock:kv_transfers_total{side}, mock:kv_transfer_rooms_failed_total{side,reason}.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from infera_mock_engine.engine import Engine


class EngineCollector:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.flavor = engine.config.engine_flavor
        self.model = engine.config.served_model_name

    def collect(self) -> Iterator[Metric]:
        yield from (self._vllm() if self.flavor == "vllm" else self._sglang())
        if self.engine.pd is not None:
            yield from self._pd()

    def _sglang(self) -> Iterator[Metric]:
        t = self.engine.totals()
        labels, values = ["model_name"], [self.model]
        gauge, counter = _families(labels, values)

        st = t.stats
        yield gauge("sglang:num_running_reqs", "The number of running requests.", t.running)
        yield gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.", t.waiting)
        yield gauge("sglang:token_usage", "The token usage (fraction of KV cache in use).", t.usage)
        yield gauge("sglang:num_used_tokens", "The number of used tokens.", t.used_tokens)
        yield gauge("sglang:max_total_num_tokens", "KV cache capacity in tokens.", t.capacity_tokens)
        hit = st.cached_tokens / st.prompt_tokens if st.prompt_tokens else 0.0
        yield gauge("sglang:cache_hit_rate", "The prefix cache hit rate.", hit)
        yield counter("sglang:prompt_tokens", "Number of prefill tokens processed.", st.prompt_tokens)
        yield counter("sglang:generation_tokens", "Number of generation tokens processed.", st.generation_tokens)
        yield counter("sglang:cached_tokens", "Number of cached prompt tokens.", st.cached_tokens)
        yield counter("sglang:num_requests", "Number of requests processed.", sum(st.finished.values()))

    def _vllm(self) -> Iterator[Metric]:
        t = self.engine.totals()
        labels, values = ["model_name", "engine"], [self.model, "0"]
        gauge, counter = _families(labels, values)

        st = t.stats
        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", t.running)
        # vLLM keeps requests waiting for remote KV in its waiting queue (WAITING_FOR_REMOTE_KVS)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", t.waiting + t.pd_pending)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", t.usage)
        yield gauge("vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.", t.usage)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", st.prompt_tokens)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", st.generation_tokens)
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of tokens.", st.prompt_tokens)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of tokens.", st.cached_tokens)
        yield counter("vllm:num_preemptions", "Cumulative number of preemptions.", st.preemptions)
        done = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                   labels=[*labels, "finished_reason"])
        for reason in ("stop", "length", "abort"):
            done.add_metric([*values, reason], st.finished.get(reason, 0))
        yield done
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=["block_size", "num_gpu_blocks", "kv_cache_size_tokens", "engine"])
        for rank in self.engine.ranks:
            kv = rank.kv
            info.add_metric([str(kv.block_size), str(kv.num_blocks), str(kv.capacity_tokens), str(rank.dp_rank)], 1)
        yield info

    def _pd(self) -> Iterator[Metric]:
        pd = self.engine.pd
        assert pd is not None
        labels, values = (["model_name"], [self.model]) if self.flavor == "sglang" else (
            ["model_name", "engine"], [self.model, "0"])
        gauge, counter = _families(labels, values)
        st = pd.stats
        if self.flavor == "sglang":
            q = pd.queues()
            yield gauge("sglang:num_prefill_prealloc_queue_reqs", "The number of requests in the prefill prealloc "
                        "queue (waiting for their decode).", q["prefill_bootstrap"])
            yield gauge("sglang:num_prefill_bootstrap_queue_reqs", "The number of requests in the prefill bootstrap "
                        "queue.", q["prefill_bootstrap"])
            yield gauge("sglang:num_prefill_inflight_queue_reqs", "The number of requests in the prefill inflight "
                        "queue (KV being sent).", q["prefill_inflight"])
            yield gauge("sglang:num_decode_prealloc_queue_reqs", "The number of requests in the decode prealloc "
                        "queue.", q["decode_prealloc"])
            yield gauge("sglang:num_decode_transfer_queue_reqs", "The number of requests in the decode transfer "
                        "queue.", q["decode_transfer"])
            yield counter("sglang:num_bootstrap_failed_reqs", "The number of bootstrap failed requests.",
                          st.bootstrap_failed)
            yield counter("sglang:num_transfer_failed_reqs", "The number of transfer failed requests.",
                          st.transfer_failed)
        yield counter("mock:kv_transfer_sent_bytes", "KV bytes this engine sent to decode engines.", st.bytes_sent)
        yield counter("mock:kv_transfer_received_bytes", "KV bytes this engine received from prefill engines.",
                      st.bytes_received)
        done = CounterMetricFamily("mock:kv_transfers", "Complete KV transfers.", labels=[*labels, "side"])
        done.add_metric([*values, "prefill"], st.transfers_sent)
        done.add_metric([*values, "decode"], st.transfers_received)
        yield done
        failed = CounterMetricFamily("mock:kv_transfer_rooms_failed", "KV transfers (rooms) that failed.",
                                     labels=[*labels, "side", "reason"])
        for (side, kind), n in sorted(st.failures.items()):
            failed.add_metric([*values, side, kind], n)
        yield failed


def make_registry(engine: Engine) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine))
    return registry


def render(registry: CollectorRegistry, accept: str | None) -> tuple[bytes, str]:
    """The exposition the scraper asked for (Accept header) and its content type."""
    encoder, content_type = choose_encoder(accept or "")
    return encoder(registry), content_type


def _families(labels: list[str], values: list[str]):
    """Builders of one-sample gauge and counter families with the flavour's labels."""

    def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=labels)
        g.add_metric(values, value)
        return g

    def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=labels)
        c.add_metric(values, value)
        return c

    return gauge, counter
