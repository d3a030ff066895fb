"""SSE decoding of engine streams, however the bytes are chunked."""

from infera_common.sse import SseDecoder, is_done

STREAM = (
    b": keep-alive comment\n\n"
    b'data: {"a": 1}\n\n'
    b'data: {"b": 2}\r\n\r\n'
    b"event: message\nid: 7\ndata: line1\ndata: line2\n\n"
    b"data:nospace\n\n"
    b"data: [DONE]\n\n"
)
EXPECTED = [b'{"a": 1}', b'{"b": 2}', b"line1\nline2", b"nospace", b"[DONE]"]


def test_whole_stream():
    d = SseDecoder()
    assert d.feed(STREAM) + d.close() == EXPECTED


def test_byte_by_byte_gives_the_same_events():
    d = SseDecoder()
    out = []
    for i in range(len(STREAM)):
        out += d.feed(STREAM[i:i + 1])
    assert out + d.close() == EXPECTED


def test_event_completes_only_at_the_blank_line():
    d = SseDecoder()
    assert d.feed(b'data: {"x"') == []
    assert d.feed(b": 1}\n") == []
    assert d.feed(b"\n") == [b'{"x": 1}']


def test_unterminated_last_event_is_flushed_on_close():
    d = SseDecoder()
    assert d.feed(b"data: tail") == []
    assert d.close() == [b"tail"]
    assert d.close() == []


def test_done_sentinel():
    assert is_done(b"[DONE]") and is_done(b" [DONE] ")
    assert not is_done(b'{"text": "[DONE]"}')


def test_field_names_are_matched_whole():
    """``data`` alone is a data line with an empty value; ``dataset:`` is another field, ignored."""
    d = SseDecoder()
    assert d.feed(b"data\ndata: x\n\ndataset: y\ndata:z\n\n") == [b"\nx", b"z"]


def test_several_events_in_one_chunk_and_one_split_across_chunks():
    d = SseDecoder()
    assert d.feed(b'data: 1\n\ndata: 2\n\ndata: 3') == [b"1", b"2"]
    assert d.feed(b'\n') == []
    assert d.feed(b'\ndata: 4\n\n') == [b"3", b"4"]
