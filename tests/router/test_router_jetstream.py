"""The broker's answers to a JetStream publish, as the router reads them (pure)."""

from __future__ import annotations

import json

from infera_router.jetstream import parse_pub_ack


def test_stored_full_gone_and_other_errors_are_told_apart():
    assert parse_pub_ack(b'{"stream":"INFERA_REQ_a","seq":7}', None).kind == "stored"
    full = json.dumps({"error": {"code": 503, "err_code": 10077, "description": "maximum messages exceeded"}})
    assert parse_pub_ack(full.encode(), None).kind == "full"
    other = parse_pub_ack(b'{"error":{"code":503,"err_code":10077,"description":"resource limits exceeded"}}', None)
    assert (other.kind, other.err_code, other.description) == ("error", 10077, "resource limits exceeded")
    assert parse_pub_ack(b"", "503").kind == "gone"  # no stream listens on the subject
    # nats-server's answer once the worker-agent sealed its queue on its way out
    sealed = b'{"error":{"code":400,"err_code":10109,"description":"invalid operation on sealed stream"}}'
    assert parse_pub_ack(sealed, None).kind == "gone"


def test_unreadable_answers_are_errors_not_successes():
    for data in (b"", b"not json", b"[1,2]", b'{"seq": 1}'):
        result = parse_pub_ack(data, None)
        assert result.kind == "error" and result.description
