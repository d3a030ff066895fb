"""KV events on ``--kv-event-transport zmq``: the kv-indexer reads the engine's publishers itself
(the record advertises them) and the agent relays nothing. It still listens until the first
stored block, whose ``block_size`` is the engine's real one (the ``KvRelayer``'s
``on_block_size`` re-registers it when it differs from what /server_info or the flags said),
then stops listening.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from infera_common.logs import get_logger
from infera_common.schemas import KvRelay
from infera_common.tasks import stop_tasks
from infera_worker_agent.kv_config import KvSource
from infera_worker_agent.kv_relay import KvRelayer
from infera_worker_agent.metrics import AgentMetrics

log = get_logger("worker_agent.kv_probe")


class KvBlockSizeProbe:
    """A ``KvRelayer`` whose publish sends nothing; closed once a stored block has been seen."""

    def __init__(
        self,
        worker_id: str,
        sources: Sequence[KvSource],
        block_size: int | None,
        *,
        replay_timeout: float,
        on_block_size: Callable[[int], Awaitable[None]],
    ) -> None:
        # its own metrics, not served: the agent's kv counters are about relaying to the bus (the
        # index size is the indexer's business here: it translates, at the size the record names)
        self._relayer = KvRelayer(worker_id, sources, block_size, self._publish, AgentMetrics(),
                                  replay_timeout=replay_timeout, on_block_size=on_block_size)
        self._seen = asyncio.Event()
        self._task: asyncio.Task | None = None

    @property
    def block_size(self) -> int | None:
        return self._relayer.block_size

    async def start(self) -> None:
        log.info("kv_events_for_the_indexer", note="the kv-indexer reads the advertised publishers; the agent reads "
                 "only the block size of the first stored block, then stops listening")
        await self._relayer.start()
        self._task = asyncio.create_task(self._close_when_settled(), name="kv-block-size-probe")

    async def close(self) -> None:
        task, self._task = self._task, None
        await stop_tasks(task)
        await self._relayer.close()

    @property
    def listening(self) -> bool:
        return not self._seen.is_set()

    async def _publish(self, relay: KvRelay) -> None:
        # the relayer settles (and re-registers) the block size before it hands on the batch that
        # showed it (a translated ``blocks`` relay, sent nowhere): from then on listening is waste
        if not self._seen.is_set() and self._relayer.block_size_seen:
            self._seen.set()

    async def _close_when_settled(self) -> None:
        await self._seen.wait()
        await self._relayer.close()
        log.info("kv_block_size_settled", block_size=self._relayer.block_size)
