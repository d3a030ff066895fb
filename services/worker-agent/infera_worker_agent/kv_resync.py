"""Answering a kv-indexer's ``KvResync`` (an adapter): put this worker's whole holding on the stream.

An index that starts replays the KV event stream; blocks whose store events left it (older than
``--kv-event-max-age``, pushed out by ``--kv-event-max-bytes``, or on a broker that lost its store)
are missing, although the engine still caches them and will never announce them again. Such an
index asks every worker-agent (``KV_RESYNC``); each relays every rank's holding
(``KvRelayer.publish_state``). Requests are coalesced: while one answer is being sent and for
``MIN_INTERVAL`` seconds after it, further requests are answered by that one (it is in the stream
for every index to read).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from infera_common.logs import get_logger
from infera_common.nats_conn import unsubscribe_quietly
from infera_common.schemas import KvResync, decode
from infera_common.tasks import stop_tasks
from infera_common.subjects import KV_RESYNC
from infera_worker_agent.kv_relay import KvRelayer

log = get_logger("worker_agent.kv_resync")

#: Seconds after an answer in which further requests are taken as answered (several indexers start together).
MIN_INTERVAL = 10.0


class ResyncListener:
    def __init__(self, nc: Any, relayer: KvRelayer) -> None:
        self._nc = nc
        self._relayer = relayer
        self._sub: Any = None
        self._task: asyncio.Task | None = None
        self._answered_at = float("-inf")

    async def start(self) -> None:
        self._sub = await self._nc.subscribe(KV_RESYNC, cb=self._on_request)

    async def stop(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            await unsubscribe_quietly(sub)
        task, self._task = self._task, None
        await stop_tasks(task)

    async def _on_request(self, msg: Any) -> None:
        try:
            requester = decode(KvResync, msg.data).requester
        except ValueError as exc:
            log.warning("bad_kv_resync", error=str(exc)[:300])
            return
        if (self._task is not None and not self._task.done()) or time.monotonic() - self._answered_at < MIN_INTERVAL:
            return  # the answer under way, or just sent, is in the stream for this requester too
        self._task = asyncio.create_task(self._answer(requester), name="kv-resync")

    async def _answer(self, requester: str) -> None:
        t0 = time.monotonic()
        parts = await self._relayer.publish_state()
        self._answered_at = time.monotonic()
        log.info("kv_state_relayed", requester=requester, parts=parts, seconds=round(self._answered_at - t0, 3))
