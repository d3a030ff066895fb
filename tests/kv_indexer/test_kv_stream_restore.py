"""The KV event stream followed again after a reconnect (``StreamFollower.restore``), against a real
nats-server: a stream that survived resumes after the last message applied, a lost one is
created again and followed from its start."""

from __future__ import annotations

import asyncio

from infera_common.kv_index.stream import StreamFollower
from infera_common.nats_conn import connect
from infera_common.subjects import KV_EVENT_STREAM, kv_event_subject
from tests.waiting import eventually


class Flag:
    def set(self, value: float) -> None:
        self.value = value


_until = eventually


async def _replayed(nats_server: str) -> tuple:
    """A follower that replayed a stream of three messages (old-0..2), what it applied so far."""
    nc = await connect(nats_server, "t")
    js = nc.jetstream()
    seen: list[bytes] = []
    follower = StreamFollower(js, lambda subject, data: seen.append(data), Flag())
    await follower.prepare(None, None)
    for i in range(3):
        await js.publish(kv_event_subject("w1"), b"old-%d" % i)
    await follower.replay()
    return nc, js, follower, seen


async def test_restore_resumes_a_surviving_stream_without_repeats_and_follows_a_new_one_from_its_start(nats_server):
    nc, js, follower, seen = await _replayed(nats_server)
    subject = kv_event_subject("w1")
    assert seen == [b"old-0", b"old-1", b"old-2"]
    await follower.restore()  # a reconnect to the same broker: resumed after old-2
    await js.publish(subject, b"old-3")
    await _until(lambda: len(seen) == 4)
    await asyncio.sleep(0.2)
    assert seen[3:] == [b"old-3"]  # nothing applied twice
    await js.delete_stream(KV_EVENT_STREAM)  # a broker that came back without its store
    await follower.restore()
    for i in range(2):
        await js.publish(subject, b"new-%d" % i)  # seqs 1, 2 again: followed from the new start
    await _until(lambda: len(seen) == 6)
    assert seen[4:] == [b"new-0", b"new-1"]
    await follower.stop()
    await follower.restore()  # stopped: nothing comes back
    await js.publish(subject, b"after-stop")
    await asyncio.sleep(0.2)
    assert len(seen) == 6
    await nc.close()


async def test_a_consumer_restarted_by_missed_heartbeats_after_a_restore_repeats_nothing(nats_server):
    nc, js, follower, seen = await _replayed(nats_server)
    subject = kv_event_subject("w1")
    await follower.restore()  # resumed at seq 4, nothing delivered since
    # what nats-py's ordered consumer does when two idle heartbeats go missing (a stalled broker):
    # it begins again after the last stream seq it delivered (was: 0, so the whole stream again)
    jsi = follower._sub._sub._jsi
    await jsi.reset_ordered_consumer(jsi._sseq + 1)
    await js.publish(subject, b"old-3")
    await _until(lambda: len(seen) == 4)
    await asyncio.sleep(0.3)
    assert seen == [b"old-0", b"old-1", b"old-2", b"old-3"] and follower.repeats == 0  # none sent again
    await follower.stop()
    await nc.close()


async def test_messages_repeated_after_a_restore_are_dropped(nats_server):
    nc, js, follower, seen = await _replayed(nats_server)
    subject = kv_event_subject("w1")
    await follower.restore()
    await follower._sub._sub._jsi.reset_ordered_consumer(1)  # a consumer that begins again from the start
    await js.publish(subject, b"old-3")
    await _until(lambda: len(seen) == 4)
    await asyncio.sleep(0.3)
    assert seen == [b"old-0", b"old-1", b"old-2", b"old-3"] and follower.repeats == 3
    await follower.stop()
    await nc.close()
