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
        self._tail = b""  # the last line, not ended yet
        self._data: list[bytes] = []  # the ``data`` values of the event under way

    def feed(self, chunk: bytes) -> list[bytes]:
        """Add bytes from the stream; returns the payloads of the events they complete."""
        if self._tail:
            chunk = self._tail + chunk
        lines = chunk.split(b"\n")
        self._tail = lines.pop()
        events: list[bytes] = []
        data = self._data
        for line in lines:  # (one event per engine write is the common case: a data line, a blank one)
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:
                if data:
                    events.append(data[0] if len(data) == 1 else b"\n".join(data))
                    data.clear()
            elif line.startswith(b"data:"):
                data.append(line[6:] if line.startswith(b"data: ") else line[5:])
            elif line == b"data":
                data.append(b"")
            # else: a comment (":...") or another field (event, id, retry): ignored
        return events

    def close(self) -> list[bytes]:
        """The stream ended: an unterminated last line and event still count."""
        tail, self._tail = self._tail, b""
        return self.feed(tail + b"\n\n") if tail or self._data else []
