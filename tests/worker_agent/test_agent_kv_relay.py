"""The KV-event relay against a fake engine publisher (ZMQ PUB + replay ROUTER) in the test."""

import asyncio

import msgpack

from infera_common.block_hash import block_hashes, pack_hashes, unpack_hashes
from infera_common.kv_translate import SLICE_BLOCKS, load_translator, state_relays
from infera_common.kv_wire import encode_seq
from infera_worker_agent.kv_config import KvSource
from infera_worker_agent import kv_relay
from infera_worker_agent.kv_follow import KvFollower
from infera_worker_agent.kv_relay import KvRelayer
from infera_worker_agent.metrics import AgentMetrics
from tests.kv_indexer.zmq_helpers import FakePublisher as ZmqFakePublisher
from tests.waiting import eventually


def tokens(seq: int) -> list[int]:
    return list(range(seq * 64, seq * 64 + 64))


def batch(seq: int) -> bytes:
    """Batch ``seq`` stores one root block of its own tokens (engine hash seq + 1)."""
    stored = ["BlockStored", [seq + 1], None, tokens(seq), 64, None, "GPU", None]
    return msgpack.packb([float(seq), [stored], 0])


def stored_hashes(relay) -> list[int]:
    return list(unpack_hashes(relay.stored.get(64, b"")))


class FakePublisher(ZmqFakePublisher):
    """The kv-indexer tests' hand-driven publisher, with every batch made from its seq and the agent's source."""

    @property
    def source(self) -> KvSource:
        return KvSource(0, f"tcp://*:{self.port}", f"tcp://*:{self.replay_port}")

    async def publish(self, seq: int, *, skip: bool = False) -> None:
        await self.send(seq, batch(seq), skip=skip)


wait_for = eventually


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
    while not any(r.kind == "blocks" and r.seq == seq - 1 for r in got) or seq == 0:
        await pub.publish(seq)
        seq += 1
        await asyncio.sleep(0.05)
        assert seq < 100


def batch_seqs(got) -> list[int]:
    return [r.seq for r in got if r.kind == "blocks"]


async def test_cleared_goes_first_then_each_batch_in_order_as_the_index_hashes_it_stored():
    pub = FakePublisher()
    relayer, got, metrics = await start_relay(pub)
    try:
        await until_subscribed(pub, got)
        assert got[0].kind == "cleared" and got[0].dp_rank is None and got[0].worker_id == "w1"
        seqs = batch_seqs(got)
        assert seqs == list(range(len(seqs)))  # no batch lost or repeated, slow joiner or not
        for r in got[1:]:
            assert r.kind == "blocks" and r.dp_rank == 0 and r.block_size == 64 and not r.reset
            assert stored_hashes(r) == block_hashes(tokens(r.seq), 64) and r.removed == {}
            assert r.payload == b""  # the token ids stay on the engine's host
        assert metrics.kv_blocks.labels("stored")._value.get() == len(seqs)
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
        assert stored_hashes(next(r for r in got if r.seq == n)) == block_hashes(tokens(n), 64)
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
        if relay.kind == "blocks" and failures["left"]:
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
        assert metrics.kv_malformed.labels("zmq")._value.get() == 2
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
        placeholder = {**stored, "token_ids": [], "block_size": 0}  # a CPU tier's (offloading): no size of its own
        for seq in range(3):  # a vLLM-on-CPU engine registered at vLLM's GPU default of 16
            pub.history[seq] = msgpack.packb([float(seq), [placeholder, stored], 0])
        await pub.pub.send_multipart([b"", encode_seq(2), pub.history[2]])  # the relay replays 0 and 1 too
        assert await wait_for(lambda: corrected == [128])
        assert relayer.block_size == 128
        await asyncio.sleep(0.2)
        assert corrected == [128]  # settled once
    finally:
        await relayer.close()
        await pub.close()


async def test_removals_and_bad_input_are_relayed_as_block_changes_and_counted():
    pub = FakePublisher()
    relayer, got, metrics = await start_relay(pub)
    try:
        await until_subscribed(pub, got)
        n = batch_seqs(got)[-1] + 1
        child = block_hashes(tokens(n), 64, block_hashes(tokens(0), 64)[0])
        events = [
            ["BlockStored", [900], 1, tokens(n), 64, None, "GPU", None],  # child of batch 0's block
            ["BlockStored", [901], 12345, tokens(n + 1), 64, None, "GPU", None],  # parent never stored
            ["BlockRemoved", [1, 777], "GPU"],  # batch 0's block, and one never stored
            ["BlockStored", [902], None, [-1] * 64, 64, None, "GPU", None],  # a token id out of range
        ]
        await pub.send(n, msgpack.packb([0.0, events, 0]))
        await pub.send(n + 1, b"\xc1 not msgpack")
        await pub.send(n + 2, msgpack.packb([0.0, [["AllBlocksCleared"]], 0]))
        assert await wait_for(lambda: n + 2 in batch_seqs(got))
        by_seq = {r.seq: r for r in got if r.kind == "blocks"}
        first = by_seq[n]
        assert stored_hashes(first) == child
        assert list(unpack_hashes(first.removed[64])) == block_hashes(tokens(0), 64)
        assert by_seq[n + 1].stored == {} and by_seq[n + 1].removed == {} and not by_seq[n + 1].reset
        assert by_seq[n + 2].reset and by_seq[n + 2].stored == {}
        assert metrics.kv_orphaned._value.get() == 1
        assert metrics.kv_unknown_removed._value.get() == 1
        assert metrics.kv_malformed.labels("event")._value.get() == 1
        assert metrics.kv_malformed.labels("batch")._value.get() == 1
        assert metrics.kv_blocks.labels("removed")._value.get() == 1
        assert pack_hashes(child) == first.stored[64]
    finally:
        await relayer.close()
        await pub.close()


async def test_what_a_failed_publish_carried_arrives_with_the_next_relay_and_a_failed_cleared_as_a_reset():
    pub = FakePublisher()
    down = {"on": True}  # JetStream unreachable at first
    got = []

    async def publish(relay):
        if down["on"]:
            raise TimeoutError("no ack")
        got.append(relay)

    relayer, _, metrics = await start_relay(pub, publish=publish)
    try:
        for seq in range(3):  # nobody subscribed yet: the relay replays them; every publish fails
            await pub.publish(seq)
        assert await wait_for(lambda: metrics.kv_publish_failures._value.get() >= 4)  # cleared + 3 batches
        down["on"] = False
        await pub.send(3, msgpack.packb([3.0, [["BlockRemoved", [2], "GPU"]], 0]))  # evicts batch 1's block
        assert await wait_for(lambda: bool(got))
        relay = got[0]
        assert (relay.kind, relay.first_seq, relay.seq, relay.reset) == ("blocks", 0, 3, True)
        want = [h for seq in (0, 2) for h in block_hashes(tokens(seq), 64)]
        assert sorted(stored_hashes(relay)) == sorted(want)
        assert list(unpack_hashes(relay.removed[64])) == block_hashes(tokens(1), 64)
        assert metrics.kv_batches.labels("0")._value.get() == 4
    finally:
        await relayer.close()
        await pub.close()


async def test_a_long_prompts_blocks_are_relayed_in_slices_letting_the_agents_other_work_run_between(monkeypatch):
    """A 32k-token prompt stored by SGLang is 512 events in one batch; translating them at once would
    hold the agent for milliseconds while the prompt's first token waits behind them to be relayed."""
    pub = FakePublisher()
    turns = {"n": 0}
    began: dict[int, int] = {}  # batch ts -> loop turns of other work when the agent began reading it
    ended: dict[int, int] = {}  # relay seq -> the same when its relay went out

    async def other_work() -> None:  # stands in for the agent's request relays
        while True:
            turns["n"] += 1
            await asyncio.sleep(0)

    read = kv_relay.read_batch

    def reading(payload: bytes):
        batch = read(payload)
        began[int(batch.ts)] = turns["n"]
        return batch

    async def collect(relay):
        ended[relay.seq] = turns["n"]

    monkeypatch.setattr(kv_relay, "read_batch", reading, raising=True)
    relayer, got, metrics = await start_relay(pub, publish=collect)
    ticker = asyncio.create_task(other_work())
    try:
        events, parent = [], None
        for i in range(512):
            events.append(["BlockStored", [1000 + i], parent, tokens(1000 + i), 64, None, "GPU", None])
            parent = 1000 + i
        for seq, batch_events in ((0, events[:1]), (1, events[1:])):
            await pub.send(seq, msgpack.packb([float(seq), batch_events, 0]))
            assert await wait_for(lambda: seq in ended)
        assert ended[0] == began[0]  # one block: no pause
        assert ended[1] - began[1] >= 511 // SLICE_BLOCKS  # the loop ran other work between the slices
        assert metrics.kv_blocks.labels("stored")._value.get() == 512
    finally:
        ticker.cancel()
        await relayer.close()
        await pub.close()


async def test_on_the_zmq_plane_the_agent_follows_the_events_for_the_block_size_and_its_state():
    """The index reads the engine itself there: the agent learns the real block size (64 here, 16
    registered) from the first stored block and re-registers it, and keeps following, so that it can
    give an index that starts late every rank's translator (``/kv_state``)."""
    pub = FakePublisher()
    sizes: list[int] = []

    async def on_block_size(size: int) -> None:
        sizes.append(size)

    follower = KvFollower("w1", [pub.source], 16, replay_timeout=2.0, on_block_size=on_block_size,
                          index_size_for=lambda page: page)
    await follower.start()
    try:
        seq = 0
        while not sizes and seq < 100:  # (ZMQ's slow joiner: the first few may be missed, replay or not)
            await pub.publish(seq)
            seq += 1
            await asyncio.sleep(0.05)
        assert follower.block_size == 64 and sizes == [64]
        for more in range(seq, seq + 3):
            await pub.publish(more)
        last = seq + 2

        async def at_last() -> list[dict]:
            return msgpack.unpackb(await follower.state(), strict_map_key=False)

        deadline = asyncio.get_running_loop().time() + 5
        while (states := await at_last()) and states[0]["seq"] != last:
            assert asyncio.get_running_loop().time() < deadline, states
            await asyncio.sleep(0.05)
        [state] = states
        held = load_translator(state["translator"]).held()[64]
        everything = {h for s in range(last + 1) for h in block_hashes(tokens(s), 64)}
        assert state["dp_rank"] == 0 and set(block_hashes(tokens(last), 64)) <= set(held) <= everything
    finally:
        await follower.close()
        await pub.close()


async def test_the_whole_holding_goes_out_as_state_parts_at_the_last_seq(monkeypatch):
    """A kv-indexer that started after the events of these blocks left the stream asks for it."""
    monkeypatch.setattr(kv_relay, "state_relays", lambda *a, **kw: state_relays(*a, **kw, part_hashes=2))
    pub = FakePublisher()
    relayer, got, _ = await start_relay(pub)
    try:
        await until_subscribed(pub, got)
        for seq in range(len(batch_seqs(got)), 6):
            await pub.publish(seq)
        assert await wait_for(lambda: batch_seqs(got)[-1:] == [5])
        got.clear()
        assert await relayer.publish_state() == 3  # 6 blocks, 2 a part
        assert [(r.kind, r.seq, r.reset, r.dp_rank) for r in got] == [
            ("state", 5, True, 0), ("state", 5, False, 0), ("state", 5, False, 0)]
        held = sorted(h for r in got for h in stored_hashes(r))
        assert held == sorted(h for seq in range(6) for h in block_hashes(tokens(seq), 64))
    finally:
        await relayer.close()
        await pub.close()
