"""Which ZMQ publishers the indexer reads for a worker record, and what a record change means (pure)."""

from infera_common.kv_zmq import ZmqKvSource
from infera_kv_indexer.zmq_plan import WorkerFeed, decide, feed_for
from tests.kv_indexer.kv_fakes import record as nats_record
from tests.kv_indexer.zmq_helpers import zmq_record


def test_each_endpoint_is_a_rank_with_its_replay_socket_and_wildcards_dial_the_advertise_host():
    rec = zmq_record("w", "tcp://0.0.0.0:5557", advertise_host="10.0.0.5").model_copy(update={
        "kv_events_endpoints": ["tcp://0.0.0.0:5557", "tcp://10.0.0.5:5558"],
        "kv_replay_endpoints": ["tcp://*:6557", ""],
    })
    feed = feed_for(rec)
    assert feed == WorkerFeed(rec.started_at, (
        ZmqKvSource(0, "tcp://10.0.0.5:5557", "tcp://10.0.0.5:6557"),
        ZmqKvSource(1, "tcp://10.0.0.5:5558", None),  # '' = no replay socket
    ))


def test_a_record_without_replay_list_or_for_one_rank_per_process():
    rec = zmq_record("w", "tcp://10.0.0.5:5557").model_copy(update={"kv_replay_endpoints": [], "dp_rank": 3})
    assert feed_for(rec).sources == (ZmqKvSource(3, "tcp://10.0.0.5:5557", None),)


def test_workers_on_the_nats_transport_or_without_publishers_are_not_read():
    assert feed_for(nats_record("w")) is None
    assert feed_for(zmq_record("w", "").model_copy(update={"kv_events_endpoints": []})) is None


def test_a_new_started_at_is_a_restart_and_other_endpoints_a_move():
    a = feed_for(zmq_record("w", "tcp://10.0.0.5:5557", started_at=1.0))
    assert decide(None, None) == "keep" and decide(a, a) == "keep"
    assert decide(None, a) == "start"
    assert decide(a, None) == "stop"
    assert decide(a, feed_for(zmq_record("w", "tcp://10.0.0.5:5557", started_at=2.0))) == "restart"
    assert decide(a, feed_for(zmq_record("w", "tcp://10.0.0.6:5557", started_at=1.0))) == "move"
