"""Where a ZMQ KV-event endpoint is reached from the engine's host and from the fleet."""

from infera_common.kv_endpoints import advertised_endpoint, is_wildcard, local_endpoint, subscriber_binds


def test_wildcards_are_dialled_locally_and_advertised_at_the_advertise_host():
    assert local_endpoint("tcp://*:5557") == "tcp://127.0.0.1:5557"
    assert local_endpoint("tcp://0.0.0.0:5557") == "tcp://127.0.0.1:5557"
    assert local_endpoint("tcp://10.1.2.3:5557") == "tcp://10.1.2.3:5557"
    assert advertised_endpoint("tcp://*:5557", "10.0.0.5") == "tcp://10.0.0.5:5557"
    assert advertised_endpoint("tcp://[::]:5557", "fe80::1") == "tcp://[fe80::1]:5557"
    assert advertised_endpoint("tcp://10.1.2.3:5557", "10.0.0.5") == "tcp://10.1.2.3:5557"
    assert advertised_endpoint("ipc:///tmp/kv", "10.0.0.5") == "ipc:///tmp/kv"


def test_the_subscriber_binds_only_where_the_engine_connects_out():
    assert not subscriber_binds("tcp://*:5557") and not subscriber_binds("tcp://0.0.0.0:5557")
    assert subscriber_binds("tcp://10.0.0.9:5557")
    assert not subscriber_binds("ipc:///tmp/kv")
    assert is_wildcard("tcp://0.0.0.0:1") and not is_wildcard("tcp://10.0.0.1:1") and not is_wildcard("ipc:///x")
