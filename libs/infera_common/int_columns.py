"""Large maps of 64-bit integers as two packed columns, for state dumps (``kv_coarse.dump_pages``,
``kv_translate.dump_translator``). Pure.

A translator of SGLang's one-token pages holds one entry per cached token: a million of them as
msgpack pairs took seconds to build, pack, unpack and rebuild in Python, on the event loops of the
worker-agent serving it and of the index reading it. As columns of machine integers each step is
one C-level pass (``array`` from an iterable, ``dict(zip(...))``).

A column is ``{"t": typecode, "b": bytes}``: ``q`` (signed 64-bit: SGLang's hashes, run keys) or
``Q`` (unsigned: vLLM's hashes, index hashes), whichever holds every value; a plain list when
neither does (a mix past both ranges), and a plain list is read back too (older dumps).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable
from typing import Any

_TYPECODES = ("q", "Q")
_NATIVE = sys.byteorder  # the bytes are written little-endian whatever the host


def pack_column(values: Iterable[int]) -> dict | list:
    values = list(values)  # (an array fills from a list twice as fast as from a dict's view)
    for code in _TYPECODES:
        try:
            column = array(code, values)
        except OverflowError:
            continue
        if _NATIVE != "little":
            column.byteswap()
        return {"t": code, "b": column.tobytes()}
    return values


def unpack_column(packed: Any) -> list[int]:
    """The integers ``pack_column`` packed; raises ``ValueError``/``TypeError``/``KeyError`` when
    ``packed`` is not a column."""
    if isinstance(packed, list):
        return [int(v) for v in packed]
    code = packed["t"]
    if code not in _TYPECODES:
        raise ValueError(f"unknown column type {code!r}")
    column = array(code)
    column.frombytes(packed["b"])  # ValueError: not a whole number of items
    if _NATIVE != "little":
        column.byteswap()
    return column.tolist()  # (a dict fills from lists faster than from arrays)


def pack_map(mapping: dict[int, int]) -> dict:
    """``{"k": column, "v": column}`` of a map's keys and values, in its order."""
    return {"k": pack_column(mapping.keys()), "v": pack_column(mapping.values())}


def unpack_map(packed: Any) -> dict[int, int]:
    """The map ``pack_map`` packed; also a list of ``[key, value]`` pairs (older dumps)."""
    if isinstance(packed, list):
        return {int(k): int(v) for k, v in packed}
    keys, values = unpack_column(packed["k"]), unpack_column(packed["v"])
    if len(keys) != len(values):
        raise ValueError(f"a map of {len(keys)} keys and {len(values)} values")
    return dict(zip(keys, values))
