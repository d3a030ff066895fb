"""Incremental Server-Sent-Events decoding: bytes in, event payloads out. Pure, no I/O.

Lines end with LF or CRLF; an empty line ends an event; ``data:`` lines (one optional space
after the colon) make the payload, joined by LF when an event has several; comments (``:``) and
other fields (``event``, ``id``, ``retry``) are ignored. The OpenAI end-of-stream sentinel is the
payload ``[DONE]``.
"""

from __future__ import annotations

DONE = b"[DONE]"


def is_done(payload: bytes) -> bool:
    return payload.strip() == DONE


class SseDecoder:
    def __init__(self) -> None:
        self._buf = bytearray()
        self._data: list[bytes] = []
        self._has_data = False

    def feed(self, chunk: bytes) -> list[bytes]:
        """Add bytes from the stream; returns the payloads of the events they complete."""
        self._buf += chunk
        events: list[bytes] = []
        start = 0
        while True:
            nl = self._buf.find(b"\n", start)
            if nl < 0:
                break
            line = bytes(self._buf[start:nl])
            start = nl + 1
            if line.endswith(b"\r"):
                line = line[:-1]
            event = self._line(line)
            if event is not None:
                events.append(event)
        del self._buf[:start]
        return events

    def close(self) -> list[bytes]:
        """The stream ended: an unterminated last line and event still count."""
        events: list[bytes] = []
        if self._buf:
            line = bytes(self._buf).rstrip(b"\r")
            self._buf.clear()
            self._line(line)
        event = self._dispatch()
        if event is not None:
            events.append(event)
        return events

    def _line(self, line: bytes) -> bytes | None:
        if not line:
            return self._dispatch()
        if line.startswith(b":"):
            return None
        field, sep, value = line.partition(b":")
        if sep and value.startswith(b" "):
            value = value[1:]
        if field == b"data":
            self._data.append(value)
            self._has_data = True
        return None

    def _dispatch(self) -> bytes | None:
        if not self._has_data:
            return None
        payload = b"\n".join(self._data)
        self._data.clear()
        self._has_data = False
        return payload
