"""JSON payloads of a stream's repeated frames, built by splicing instead of re-encoding (pure).

A streamed response sends nearly the same JSON object for every token: an OpenAI chunk differs only
in its text delta, a SGLang /generate frame only grows (its text and ids are everything so far, so
encoding it whole made a stream's cost grow with the square of its length). These builders encode
the constant part once and splice the changing part in. The bytes are exactly `http_common.dumps` of the full object
(`ensure_ascii=False`, separators `,` and `:`), which the tests check.
"""

from __future__ import annotations

from collections.abc import Iterable
from json.encoder import encode_basestring  # a str as dumps(..., ensure_ascii=False) writes it

#: The placeholder a template carries where the text goes; it encodes as "\u0000".
TEXT_SLOT = "\x00"
_SLOT_JSON = encode_basestring(TEXT_SLOT).encode()


def json_str(text: str) -> bytes:
    """`text` as a JSON string, the bytes `dumps` writes for it."""
    return encode_basestring(text).encode()


class TextSplice:
    """`dumps` of a template object with its text slot set to a given text.

    `template` is `dumps(obj)` of an object holding the string `TEXT_SLOT` where the text goes; no
    string equal to `TEXT_SLOT` may follow that slot in the encoding (strings before it may be anything:
    the last occurrence is taken)."""

    def __init__(self, template: bytes) -> None:
        i = template.rfind(_SLOT_JSON)
        if i < 0:
            raise ValueError("the template has no text slot")
        self._head = template[:i]
        self._tail = template[i + len(_SLOT_JSON):]

    def __call__(self, text: str) -> bytes:
        return self._head + json_str(text) + self._tail


class CumulativeOutput:
    """SGLang /generate stream frames `{"text", "output_ids", "meta_info"}`, each carrying everything
    generated so far: the text and ids are kept JSON-encoded and extended per frame, so a frame costs
    a copy of what came before, not encoding it again. (JSON escapes a string one character at a time,
    so the encoding of a text is the encodings of its pieces put together.)"""

    def __init__(self) -> None:
        self._text_json = bytearray()  # the JSON string's inside, without its quotes
        self._ids_json = bytearray()  # the array's inside, without its brackets

    def add(self, text: str, ids: Iterable[int]) -> None:
        self._text_json += json_str(text)[1:-1]
        new = ",".join(map(str, ids)).encode()
        if new:
            self._ids_json += b"," + new if self._ids_json else new

    def frame(self, meta_json: bytes) -> bytes:
        """The frame's JSON, `meta_json` being `dumps` of its meta_info."""
        return b"".join((b'{"text":"', self._text_json, b'","output_ids":[', self._ids_json, b'],"meta_info":',
                         meta_json, b"}"))
