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
