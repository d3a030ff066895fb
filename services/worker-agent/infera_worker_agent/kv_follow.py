"""KV events on ``--kv-event-transport zmq``: the index reads the engine's publishers itself (the
record advertises them) and the agent relays nothing. It follows them all the same, translated at
the worker's index block size and sent nowhere (a ``KvRelayer`` whose publish is a no-op), for two
things only it can give:

- the engine's real block size, from the first stored block (``on_block_size`` re-registers it
  when it differs from what /server_info or the flags said);
- every rank's translator (``kv_translate.dump_translator``: what it holds and the engine hashes
  that name it) and the seq of its last batch, served at ``GET /kv_state`` on the agent's metrics
  port (a msgpack array of ``{"dp_rank", "seq", "translator"}``) and advertised as the record's
  ``kv_state_url``. An index that starts following the worker (a restarted ``infera.server``)
  reads it before the engine's replay: the engine's replay buffer holds only its last batches, and
  blocks stored before them (and every block later stored on top of them, whose parent it would
  not know) would stay unknown.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

import msgpack
from aiohttp import web

from infera_common.kv_endpoints import url_host
from infera_common.logs import get_logger
from infera_common.schemas import KvRelay
from infera_worker_agent.engine_cmd import WILDCARD_HOSTS
from infera_worker_agent.kv_config import KvSource
from infera_worker_agent.kv_relay import KvRelayer
from infera_worker_agent.metrics import AgentMetrics

log = get_logger("worker_agent.kv_follow")

STATE_PATH = "/kv_state"


def state_url(metrics_host: str, advertise_host: str, port: int) -> str:
    """Where an index reaches ``/kv_state``: the advertise host when the metrics port listens on every
    address, else the address it listens on (127.0.0.1: this host only)."""
    host = advertise_host if metrics_host in WILDCARD_HOSTS else metrics_host
    return f"http://{url_host(host)}:{port}{STATE_PATH}"


class KvFollower:
    def __init__(self, worker_id: str, sources: Sequence[KvSource], block_size: int | None, *,
                 replay_timeout: float, on_block_size: Callable[[int], Awaitable[None]],
                 index_size_for: Callable[[int | None], int | None]) -> None:
        # its own metrics, not served: the agent's kv counters are about relaying to the bus
        self._relayer = KvRelayer(worker_id, sources, block_size, self._discard, AgentMetrics(),
                                  replay_timeout=replay_timeout, on_block_size=on_block_size,
                                  index_size_for=index_size_for)

    @property
    def block_size(self) -> int | None:
        return self._relayer.block_size

    async def start(self) -> None:
        log.info("kv_events_followed", note="the index reads the advertised publishers; the agent follows them "
                 f"too, for the block size and for {STATE_PATH}")
        await self._relayer.start()

    async def close(self) -> None:
        await self._relayer.close()

    async def state(self) -> bytes:
        """Every rank's translator and last seq, msgpack."""
        return msgpack.packb(await self._relayer.translator_states(), use_bin_type=True)

    @staticmethod
    async def _discard(relay: KvRelay) -> None:
        """Nothing is relayed on this plane."""


async def serve_state(follower: KvFollower | None) -> web.Response:
    """``GET /kv_state``: the follower's state, or 503 while there is none (starting, or not this plane)."""
    if follower is None:
        return web.json_response({"error": "this worker-agent does not follow its engine's KV events "
                                           "(it is not on --kv-event-transport zmq, or not started yet)"},
                                 status=503)
    return web.Response(body=await follower.state(), content_type="application/x-msgpack")
