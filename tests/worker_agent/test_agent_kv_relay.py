"""The KV-event relay against a fake engine publisher (ZMQ PUB + replay ROUTER) in the test."""

import asyncio

import msgpack

from infera_common.kv_wire import encode_seq
from infera_worker_agent.kv_config import KvSource
from infera_worker_agent.kv_relay import KvRelayer
from infera_worker_agent.metrics import AgentMetrics
from tests.kv_indexer.zmq_helpers import FakePublisher as ZmqFakePublisher


def batch(seq: int) -> bytes:
    return msgpack.packb([float(seq), [["AllBlocksCleared"]], 0])


class FakePublisher(ZmqFakePublisher):
    """The kv-indexer tests' hand-driven publisher, with every batch made from its seq and the agent's source."""

    @property
    def source(self) -> KvSource:
        return KvSource(0, f"tcp://*:{self.port}", f"tcp://*:{self.replay_port}")

    async def publish(self, seq: int, *, skip: bool = False) -> None:
        await self.send(seq, batch(seq), skip=skip)


async def wait_for(predicate, timeout: float = 10.0) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.02)
    return predicate()


async def start_relay(pub: FakePublisher, publish=None):
    got = []

    async def collect(relay):
        got.append(relay)

    metrics = AgentMetrics()
    relayer = KvRelayer("w1", [pub.source], 64, publish or collect, metrics, replay_timeout=2.0)
    await relayer.start()
    return relayer, got, metrics


async def until_subscribed(pub: FakePublisher, got) -> None:
    """Publish probe batches until one arrives (ZMQ's slow joiner), so the test's seqs start clean."""
    seq = 0
    while not any(r.kind == "batch" and r.seq == seq - 1 for r in got) or seq == 0:
        await pub.publish(seq)
        seq += 1
        await asyncio.sleep(0.05)
        assert seq < 100


def batch_seqs(got) -> list[int]:
    return [r.seq for r in got if r.kind == "batch"]


async def test_cleared_goes_first_then_batches_verbatim_in_order():
    pub = FakePublisher()
    relayer, got, metrics = await start_relay(pub)
    try:
        await until_subscribed(pub, got)
        assert got[0].kind == "cleared" and got[0].dp_rank is None and got[0].worker_id == "w1"
        seqs = batch_seqs(got)
        assert seqs == list(range(len(seqs)))  # no batch lost or repeated, slow joiner or not
        assert all(r.payload == pub.history[r.seq] and r.dp_rank == 0 and r.block_size == 64
                   for r in got if r.kind == "batch")
    finally:
        await relayer.close()
        await pub.close()


async def test_batches_published_before_the_relay_started_come_from_replay():
    pub = FakePublisher()
    for seq in range(3):
        await pub.publish(seq)  # nobody subscribed yet: lost on PUB, kept for replay
    relayer, got, _ = await start_relay(pub)
    try:
        assert await wait_for(lambda: batch_seqs(got) == [0, 1, 2])
        assert pub.replay_requests[0] == 0
    finally:
        await relayer.close()
        await pub.close()


async def test_a_skipped_seq_is_filled_from_replay_before_the_batch_that_revealed_it():
    pub = FakePublisher()
    relayer, got, metrics = await start_relay(pub)
    try:
        await until_subscribed(pub, got)
        n = batch_seqs(got)[-1] + 1
        await pub.publish(n, skip=True)  # never on PUB, only in replay
        await pub.publish(n + 1)
        assert await wait_for(lambda: n + 1 in batch_seqs(got))
        assert batch_seqs(got) == list(range(n + 2))
        assert next(r for r in got if r.seq == n).payload == pub.history[n]
        assert metrics.kv_gaps.labels("filled")._value.get() == 1
    finally:
        await relayer.close()
        await pub.close()


async def test_a_gap_replay_cannot_fill_is_counted_and_the_batch_still_relayed():
    pub = FakePublisher()
    relayer, got, metrics = await start_relay(pub)
    try:
        await until_subscribed(pub, got)
        n = batch_seqs(got)[-1] + 1
        await pub.publish(n, skip=True)
        del pub.history[n]  # gone from replay too
        await pub.publish(n + 1)
        assert await wait_for(lambda: n + 1 in batch_seqs(got))
        assert n not in batch_seqs(got)
        assert metrics.kv_gaps.labels("unrecoverable")._value.get() == 1
        assert metrics.kv_lost_batches._value.get() == 1
    finally:
        await relayer.close()
        await pub.close()


async def test_malformed_messages_and_failed_publishes_do_not_stop_the_relay():
    pub = FakePublisher()
    failures = {"left": 1}
    got = []

    async def flaky(relay):
        if relay.kind == "batch" and failures["left"]:
            failures["left"] -= 1
            raise TimeoutError("no ack")
        got.append(relay)

    relayer, _, metrics = await start_relay(pub, publish=flaky)
    try:
        await until_subscribed(pub, got)
        n = batch_seqs(got)[-1] + 1
        await pub.pub.send_multipart([b"", b"short"])  # 2 frames
        await pub.pub.send_multipart([b"", b"bad", b"x"])  # seq frame not 8 bytes
        await pub.publish(n)
        assert await wait_for(lambda: n in batch_seqs(got))
        assert metrics.kv_malformed._value.get() == 2
        assert metrics.kv_publish_failures._value.get() == 1
    finally:
        await relayer.close()
        await pub.close()


async def test_the_first_stored_block_settles_the_block_size_the_worker_registers():
    pub = FakePublisher()
    corrected: list[int] = []

    async def on_block_size(size: int) -> None:
        corrected.append(size)

    relayer = KvRelayer("w1", [pub.source], 16, lambda relay: asyncio.sleep(0), AgentMetrics(),
                        replay_timeout=2.0, on_block_size=on_block_size)
    await relayer.start()
    try:
        stored = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                  "token_ids": list(range(128)), "block_size": 128, "lora_id": None, "medium": "CPU"}
        for seq in range(3):  # a vLLM-on-CPU engine registered at vLLM's GPU default of 16
            pub.history[seq] = msgpack.packb([float(seq), [stored], 0])
        await pub.pub.send_multipart([b"", encode_seq(2), pub.history[2]])  # the relay replays 0 and 1 too
        assert await wait_for(lambda: corrected == [128])
        assert relayer.block_size == 128
        await asyncio.sleep(0.2)
        assert corrected == [128]  # settled once
    finally:
        await relayer.close()
        await pub.close()
