"""The shared ZMQ KV-event reader on real sockets: ordering, readiness, restarts, and a failing handler."""

from __future__ import annotations

from infera_common.kv_zmq import KvReadObserver, KvZmqReader, ZmqKvSource
from tests.kv_indexer.zmq_helpers import FakePublisher, empty_batch, eventually, probe_until


class Seen(KvReadObserver):
    def __init__(self) -> None:
        self.up: list[bool] = []
        self.restarts: list[int] = []

    def connected(self, source, up):
        self.up.append(up)

    def restarted(self, source, seq):
        self.restarts.append(seq)


def source(pub: FakePublisher, replay: bool = True) -> ZmqKvSource:
    return ZmqKvSource(0, f"tcp://127.0.0.1:{pub.port}", f"tcp://127.0.0.1:{pub.replay_port}" if replay else None)


async def test_ready_after_the_first_replay_and_batches_in_order_despite_a_failing_handler():
    pub = FakePublisher()
    for seq in range(3):
        await pub.send(seq, empty_batch(float(seq)), skip=True)  # published before anyone listened
    got: list[int] = []

    async def on_batch(src, seq, payload):
        got.append(seq)
        if seq == 1:
            raise RuntimeError("the user's bug")

    seen = Seen()
    reader = KvZmqReader([source(pub)], on_batch, observer=seen, monitor=True, replay_timeout=2.0)
    reader.start()
    try:
        await eventually(reader.ready.is_set)
        assert got == [0, 1, 2]  # the failing batch 1 did not stop the rank
        await pub.send(3, empty_batch(3.0))
        await probe_until(pub, 3, lambda: got == [0, 1, 2, 3])
        await eventually(lambda: seen.up == [True])
    finally:
        await reader.close()
        await pub.close()
    assert seen.up == [True, False]  # closing reports the publisher gone


async def test_a_reader_without_restart_handler_drops_a_new_engines_old_seqs_and_one_with_it_starts_over():
    pub = FakePublisher()
    plain: list[tuple[int, bytes]] = []
    aware: list[tuple[int, bytes]] = []
    seen = Seen()

    def keep(into):
        async def on_batch(src, seq, payload):
            into.append((seq, payload))
        return on_batch

    async def restarted(src, seq):
        aware.append((-1, b"restart"))

    readers = [KvZmqReader([source(pub, replay=False)], keep(plain)),
               KvZmqReader([source(pub, replay=False)], keep(aware), on_restart=restarted, observer=seen)]
    for reader in readers:
        reader.start()
    try:
        for seq in range(2):
            await pub.send(seq, empty_batch(float(seq)))
            await probe_until(pub, seq, lambda: len(plain) > seq and len(aware) > seq)
        await pub.close()
        pub = FakePublisher(pub.port, pub.replay_port)  # a new engine on the same ports
        await pub.send(0, empty_batch(100.0))
        await probe_until(pub, 0, lambda: len(aware) == 4)
        assert aware[2:] == [(-1, b"restart"), (0, empty_batch(100.0))] and seen.restarts == [0]
        assert [seq for seq, _ in plain] == [0, 1]  # the agent's relay: a lower seq is a duplicate
    finally:
        for reader in readers:
            await reader.close()
        await pub.close()


async def test_readers_opened_and_closed_in_turn_on_one_context_keep_no_file_descriptor_and_all_open():
    """The kv-indexer closes a leaving worker's reader and opens one for each worker that joins, on
    one ZMQ context. Two faults met an etcd blip (every worker leaving and joining at once): each
    closed reader kept three file descriptors (its monitor's MONITOR_STOPPED, never taken), and a
    monitor named after its socket's descriptor collided with a closed one's name (EADDRINUSE), so
    that worker was never read again."""
    import asyncio
    import os

    import zmq.asyncio
    from structlog.testing import capture_logs

    async def on_batch(src, seq, payload):
        pass

    pub = FakePublisher()
    ctx = zmq.asyncio.Context()
    before = len(os.listdir("/proc/self/fd"))
    try:
        with capture_logs() as logs:
            for _ in range(200):
                reader = KvZmqReader([source(pub, replay=False)], on_batch, context=ctx, monitor=True)
                reader.start()
                await asyncio.sleep(0)
                await reader.close()
        failed = [e for e in logs if e["event"] == "kv_subscribe_failed"]
        assert not failed, failed[0]  # every one opened its socket and monitor
        # libzmq's reaper thread closes a closed socket's descriptors a moment later (on a loaded
        # machine, dozens were still open right after the loop): what stays open for good is a leak
        await eventually(lambda: len(os.listdir("/proc/self/fd")) - before < 20, 10,
                         what="the closed readers' descriptors released")  # (was 3 per reader for good: 600)
    finally:
        ctx.destroy(linger=0)
        await pub.close()


async def test_a_rank_whose_socket_cannot_be_opened_is_tried_again_until_it_can():
    """A reader binding an endpoint another socket still holds waits for it, not gives up."""
    import asyncio

    import zmq
    import zmq.asyncio

    from infera.procs import free_port

    port = free_port()
    ctx = zmq.asyncio.Context()
    holder = ctx.socket(zmq.PUB)
    holder.bind(f"tcp://127.0.0.1:{port}")
    got: list[int] = []

    async def on_batch(src, seq, payload):
        got.append(seq)

    reader = KvZmqReader([ZmqKvSource(0, f"tcp://127.0.0.1:{port}", None, bind=True)], on_batch, monitor=True)
    reader.start()
    try:
        await eventually(reader.ready.is_set)  # readiness does not wait for a rank that cannot open
        holder.close(linger=0)  # the port is free again: the next attempt binds it
        engine = ctx.socket(zmq.PUB)  # the engine connects out to the bound reader
        engine.connect(f"tcp://127.0.0.1:{port}")
        try:
            from tests.kv_indexer.zmq_helpers import empty_batch as batch
            from infera_common.kv_wire import encode_seq

            async def sent() -> bool:
                await engine.send_multipart([b"", encode_seq(0), batch(0.0)])
                return bool(got)

            for _ in range(100):
                if await sent():
                    break
                await asyncio.sleep(0.1)
            assert got and got[0] == 0
        finally:
            engine.close(linger=0)
    finally:
        await reader.close()
        ctx.destroy(linger=0)
