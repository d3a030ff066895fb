"""An engine's disaggregation role: the bootstrap server (prefill), the HTTP client that pulls KV
(decode), the rooms in flight, the sessions of disaggregated requests and their counters."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import Any

import aiohttp

from infera_mock_engine.config import EngineConfig
from infera_mock_engine.pd_bootstrap import BootstrapServer
from infera_mock_engine.pd_request import PdRequest
from infera_mock_engine.pd_rooms import RoomTable, TransferFailed
from infera_mock_engine.pd_session import DecodeSession, PdSession, SglangPrefillSession, VllmProducerSession
from infera_mock_engine.pd_stats import PdStats
from infera_mock_engine.pd_transfer import PrefillDirectory
from infera_mock_engine.ranks import EngineRank
from infera_mock_engine.scheduler import Sequence

log = logging.getLogger("infera_mock_engine.pd")


class Disaggregation:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.cfg = config.disagg
        self.stats = PdStats()
        ttl = max(self.cfg.bootstrap_timeout, self.cfg.waiting_timeout, self.cfg.abort_request_timeout)
        self.rooms = RoomTable(ttl, on_fail=lambda f: self.stats.failed("prefill", f.kind))
        self.sessions: set[PdSession] = set()
        self.server: BootstrapServer | None = None
        if self.cfg.serves_prefill:
            self.server = BootstrapServer(self.cfg, config.host, config.dp_size, config.page_size, self.rooms,
                                          self.stats)
        self.client: aiohttp.ClientSession | None = None
        self.directory: PrefillDirectory | None = None

    async def start(self, sock: socket.socket | None = None) -> None:
        """Listen on the bootstrap port (prefill; raises BootstrapError) and open the KV client (decode)."""
        if self.server is not None:
            await self.server.start(sock)
        if self.cfg.serves_decode:
            self.client = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
            self.directory = PrefillDirectory(self.client)

    async def stop(self) -> None:
        tasks = [s.task for s in self.sessions if s.task is not None]
        for s in list(self.sessions):
            s.abort("the engine is stopping")
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self.rooms.fail_all(TransferFailed("the prefill engine is stopping", "stopping"))
        if self.server is not None:
            await self.server.stop()
        if self.client is not None:
            await self.client.close()
            self.client = None

    def session(self, seq: Sequence, rid: str, rank: EngineRank, req: PdRequest) -> PdSession:
        if req.role == "decode":
            return DecodeSession(self, seq, rid, rank, req)
        if req.protocol == "sglang":
            return SglangPrefillSession(self, seq, rid, rank, req)
        return VllmProducerSession(self, seq, rid, rank, req)

    @property
    def bootstrap_port(self) -> int | None:
        if self.server is not None and self.server.port is not None:
            return self.server.port
        return self.cfg.bootstrap_port if self.cfg.serves_prefill else None

    def queues(self) -> dict[str, int]:
        """SGLang's PD queue gauges: prefill requests waiting for their decode (bootstrap/prealloc), prefill
        KV being handed over (inflight), decode requests locating their prefill (prealloc) and receiving
        their KV (transfer)."""
        q = {"prefill_bootstrap": 0, "prefill_inflight": 0, "decode_prealloc": 0, "decode_transfer": 0}
        for s in self.sessions:
            if s.role == "prefill" and s.phase == "bootstrap":
                q["prefill_bootstrap"] += 1
            elif s.role == "prefill" and s.phase == "transfer":
                q["prefill_inflight"] += 1
            elif s.role == "decode" and s.phase == "bootstrap":
                q["decode_prealloc"] += 1
            elif s.role == "decode" and s.phase == "transfer":
                q["decode_transfer"] += 1
        return q

    def info(self) -> dict[str, Any]:
        """/server_info `disaggregation`: what a worker-agent registers, and the transfer counters."""
        cfg, dp = self.cfg, self.config.dp_size
        return {
            "mode": cfg.mode,
            "protocol": "sglang-bootstrap" if cfg.protocol == "sglang" else "vllm-mooncake",
            "bootstrap_host": self.config.host if cfg.serves_prefill else None,
            "bootstrap_port": self.bootstrap_port,
            "engine_id": cfg.engine_id,
            "engine_ids": [cfg.rank_engine_id(r, dp) for r in range(dp)] if cfg.engine_id else None,
            "kv_role": (cfg.kv_transfer_config or {}).get("kv_role"),
            "transfer_backend": cfg.transfer_backend if cfg.protocol == "sglang" else "mooncake",
            "kv_bytes_per_token": cfg.kv_bytes_per_token,
            "kv_transfer_bandwidth": cfg.kv_transfer_bandwidth,
            "bootstrap_timeout": cfg.bootstrap_timeout if cfg.protocol == "sglang" else None,
            "waiting_timeout": cfg.waiting_timeout if cfg.protocol == "sglang" else None,
            "abort_request_timeout": cfg.abort_request_timeout if cfg.protocol == "vllm" else None,
            "kv_load_failure_policy": cfg.kv_load_failure_policy if cfg.protocol == "vllm" else None,
            "rooms_in_flight": len(self.rooms),
            "queues": self.queues(),
            **self.stats.as_dict(),
        }
