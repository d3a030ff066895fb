"""The client's session header (opt-in session affinity): read every value, change none. Pure, no I/O.

The frontend never interprets the id and never adds it to the model input: it hands all the values
it received, in order, to the router (``RouteRequest.session_ids``), which validates them.
"""

from __future__ import annotations

from collections.abc import Mapping

from infera_common.schemas import SESSION_HEADER

__all__ = ["SESSION_HEADER", "http_session_ids", "nats_session_ids"]

_LOWER = SESSION_HEADER.lower()


def nats_session_ids(headers: Mapping[str, str] | None) -> list[str]:
    """The session header's values in NATS message headers (names compared without case).

    The Python NATS client keeps one value per header name, so a name repeated with the same
    spelling arrives as its last value; spellings that differ in case arrive as several values.
    """
    if not headers:
        return []
    return [value for name, value in headers.items() if name.lower() == _LOWER]


def http_session_ids(values: list[str]) -> list[str]:
    """The session header's values from aiohttp, each as a string the bus can carry.

    aiohttp decodes header bytes that are not UTF-8 into lone surrogates, which cannot be encoded
    again (the route request failed with 500). Such a value is carried as its bytes read as
    Latin-1 instead: the same bytes give the same id, so the session still sticks."""
    return [_carried(value) for value in values]


def _carried(value: str) -> str:
    try:
        value.encode("utf-8")
        return value
    except UnicodeEncodeError:
        pass
    try:
        return value.encode("utf-8", "surrogateescape").decode("latin-1")
    except UnicodeEncodeError:  # a surrogate that stands for no byte
        return value.encode("utf-8", "surrogatepass").decode("latin-1")
