"""Response frames on the hot path: the fast encoder and decoder give exactly what the models give."""

import msgpack
import msgspec
import pytest

from infera_common.frames import decode_frame, encode_frame
from infera_common.schemas import Frame, decode, encode


def as_model(wire) -> Frame:
    return Frame(**msgspec.structs.asdict(wire))


@pytest.mark.parametrize("fields", [
    {"kind": "head", "seq": 0, "status": 200},
    {"kind": "data", "seq": 7, "body": b'{"choices": []}'},
    {"kind": "head", "seq": 0, "status": 400, "body": b"{}", "final": True},
    {"kind": "error", "seq": 3, "status": 502, "message": "engine gone"},
    {"kind": "error", "seq": 0, "status": 502, "message": "prefill failed", "failed_worker": "w-p1"},
    {"kind": "error", "seq": 0, "status": 502, "message": "engine unreachable", "unreached": True},
    {"kind": "end", "seq": 9},
])
def test_the_fast_path_matches_the_model_both_ways(fields):
    data = encode_frame(**fields)
    assert as_model(decode_frame(data)) == decode(Frame, data) == Frame(**fields)
    full = encode(Frame(**fields))  # what a sender that writes every field puts on the bus
    assert as_model(decode_frame(full)) == Frame(**fields)
    # a field at its default is left out: a data frame is its kind, number and payload alone
    assert set(msgpack.unpackb(data)) == {"kind", *(k for k, v in fields.items() if v != Frame.model_fields[k].default)}


def test_a_data_frame_leaves_its_defaults_out():
    data = encode_frame("data", 7, body=b'{"choices": []}')
    assert msgpack.unpackb(data) == {"kind": "data", "seq": 7, "body": b'{"choices": []}'}
    assert len(data) < len(encode(Frame(kind="data", seq=7, body=b'{"choices": []}'))) - 40


def test_anything_unusual_is_still_validated():
    loose = msgpack.packb({"kind": "data", "seq": "3", "body": b"x"}, use_bin_type=True)  # a str seq: coerced
    assert as_model(decode_frame(loose)) == Frame(kind="data", seq=3, body=b"x")
    for bad in (msgpack.packb({"kind": "nope", "seq": 1}), msgpack.packb([1, 2]), b"\xc1", b""):
        with pytest.raises(ValueError):
            decode_frame(bad)


def test_a_frame_from_a_sender_that_names_no_failed_worker_still_decodes():
    older = msgpack.packb({"kind": "error", "seq": 0, "status": 503, "body": b"", "message": "m", "final": False},
                          use_bin_type=True)
    assert decode_frame(older).failed_worker == ""
