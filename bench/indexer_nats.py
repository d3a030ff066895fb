"""The kv-indexer bench's measurements over a real nats-server (``bench/indexer.py``): overlap queries
through ``nc.request``, and a restarted indexer replaying its JetStream stream."""

from __future__ import annotations

import asyncio
import time

import nats

from benchfleet import nats_server
from indexer_workload import check
from infera_common.nats_conn import ensure_kv_event_stream
from infera_common.schemas import OverlapReply, decode
from infera_common.subjects import KV_EVENT_STREAM, KV_QUERY
from infera_common.kv_index.index import KvIndex
from infera_kv_indexer.service import KvIndexerService
from infera_kv_indexer.settings import KvIndexerSettings


async def nats_queries(index: KvIndex, queries: list[bytes], replies: list[bytes], wants: list[dict[str, int]],
                       n: int) -> tuple[list[float], list[float]]:
    """Query latency over a real nats-server, the kv-indexer service serving ``index`` on this loop,
    against an echo responder on the same server replying a message of the same size."""
    with nats_server("bench-indexer-") as url:
        svc = client = echo_nc = None
        try:
            svc = KvIndexerService(KvIndexerSettings(nats_url=url, log_level="warning"))
            svc.index = index  # serve the index built above (the stream is empty: nothing to replay)
            await svc.start()
            client = await nats.connect(url)
            echo_nc = await nats.connect(url)
            sized = {len(q): r for q, r in zip(queries, replies)}

            async def echo(msg) -> None:  # the bus alone: reply a message as long as the real reply
                await msg.respond(sized[len(msg.data)])

            await echo_nc.subscribe("bench.echo", cb=echo)
            await echo_nc.flush()
            lat, base = [], []
            for i in range(n + 100):
                q = queries[i % len(queries)]
                t0 = time.perf_counter()
                msg = await client.request(KV_QUERY, q, timeout=5)
                t1 = time.perf_counter()
                await client.request("bench.echo", q, timeout=5)
                t2 = time.perf_counter()
                if i < len(queries):
                    check(decode(OverlapReply, msg.data), wants[i % len(queries)])
                if i >= 100:  # warm-up
                    lat.append(t1 - t0)
                    base.append(t2 - t1)
            return lat, base
        finally:
            for nc in (client, echo_nc):
                if nc is not None:
                    await nc.close()
            if svc is not None:
                await svc.stop()


async def replay_rate(relays: list[tuple[str, bytes]], want_blocks: int) -> float:
    """Seconds from a kv-indexer's ``start()`` to serving, over a stream holding ``relays``."""
    with nats_server("bench-indexer-") as url:
        svc = None
        try:
            settings = KvIndexerSettings(nats_url=url, log_level="warning")
            nc = await nats.connect(url)
            js = nc.jetstream()
            await ensure_kv_event_stream(js, settings.kv_event_max_age, settings.kv_event_max_bytes)
            for subject, data in relays:  # stored by the stream as they arrive (no ack wait)
                await nc.publish(subject, data)
            await nc.flush()
            while (await js.stream_info(KV_EVENT_STREAM)).state.messages < len(relays):
                await asyncio.sleep(0.05)
            await nc.close()
            svc = KvIndexerService(settings)
            t0 = time.perf_counter()
            await svc.start()
            seconds = time.perf_counter() - t0
            held = sum(svc.index.worker_blocks(w) for w in {s.rsplit(".", 1)[1] for s, _ in relays})
            if svc.messages != len(relays) or held != want_blocks:
                raise RuntimeError(f"replay applied {svc.messages} of {len(relays)} messages, {held} of {want_blocks} blocks")
            return seconds
        finally:
            if svc is not None:
                await svc.stop()
