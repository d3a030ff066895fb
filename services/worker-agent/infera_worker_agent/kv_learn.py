"""What the agent learns of its engine's KV cache once it is healthy: the page size (and the index
block size it gives), the capacity, and the KV-event publishers it actually bound; and the record
fields that advertise them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import aiohttp

from infera_common.logs import get_logger
from infera_worker_agent.engine_cmd import EnginePlan
from infera_worker_agent.health import engine_json, engine_text
from infera_worker_agent.kv_capacity import capacity_tokens
from infera_worker_agent.kv_config import (
    KvSource, advertised_endpoint, block_size, block_size_notes, index_block_size, resolve_sources,
)

log = get_logger("worker_agent")


@dataclass
class EngineKv:
    index_block_setting: int | None  # --kv-index-block-size
    block_size: int | None = None  # the engine's page size
    index_block_size: int | None = None  # what the router hashes at (a multiple of the page)
    capacity_tokens: int | None = None  # the KV cache of each DP rank, in tokens
    sources: tuple[KvSource, ...] = ()

    async def learn(self, session: aiohttp.ClientSession, plan: EnginePlan, info: dict | None) -> None:
        """Read them from the running engine (``info``: its server info)."""
        engine, base = plan.engine, plan.local_url
        self.set_block_size(block_size(engine, info, plan.engine_args))
        metrics = await engine_text(session, f"{base}/metrics") if engine == "vllm" else None
        self.capacity_tokens = capacity_tokens(engine, info, metrics)
        if self.capacity_tokens is None:
            log.warning("kv_capacity_unknown", engine=engine,
                        note="routers will not weigh what placing a prompt here evicts (kv-aware)")
        kv = plan.kv_events
        if kv is None or not kv.enabled:
            return
        event_sources = None
        if engine in ("vllm", "mock"):
            event_sources = await engine_json(session, f"{base}/kv_event_sources")
        self.sources = resolve_sources(kv.sources, event_sources, info)
        log.info("kv_events_found", block_size=self.block_size, index_block_size=self.index_block_size,
                 capacity_tokens=self.capacity_tokens,
                 sources=[(s.dp_rank, s.endpoint, s.replay_endpoint) for s in self.sources])
        self.note_block_size()

    def index_size_for(self, page: int | None) -> int | None:
        return index_block_size(page, self.index_block_setting)[0]

    def set_block_size(self, page: int | None) -> None:
        """The engine's page size and the index block size it gives."""
        self.block_size = page
        self.index_block_size = self.index_size_for(page)

    def note_block_size(self) -> None:
        for level, event, fields in block_size_notes(self.block_size, self.index_block_setting):
            getattr(log, level)(event, **fields)

    def record_fields(self, advertise_host: str) -> dict[str, Any]:
        """The worker record's KV fields: sizes, capacity, and the publishers as other hosts reach them."""
        return {
            "kv_block_size": self.block_size, "kv_index_block_size": self.index_block_size,
            "kv_capacity_tokens": self.capacity_tokens,
            "kv_events_endpoints": [advertised_endpoint(s.endpoint, advertise_host) for s in self.sources],
            "kv_replay_endpoints": [advertised_endpoint(s.replay_endpoint, advertise_host) if s.replay_endpoint
                                    else "" for s in self.sources],
        }
