"""The engine's KV-events configuration and where its publishers are: pure rules, no I/O.

Unless the user passed ``--kv-events-config`` (then it is kept and its endpoints are read) or the
agent runs with ``--no-enable-kv-events``, the agent appends
``--kv-events-config '{"publisher":"zmq","endpoint":"tcp://*:P","replay_endpoint":"tcp://*:R","topic":""}'``
(plus ``"enable_kv_cache_events": true`` for vLLM; SGLang ignores it). The engines offset both
ports by the DP rank (rank r on P+r and R+r), so P..P+dp-1 and R..R+dp-1 must all be free: the
caller passes ``find_ports(n)`` returning the first port of n contiguous free ports.

After health the engine's own report wins over the plan: vLLM's ``GET /kv_event_sources`` (0.32: a
map from DP rank to ``{endpoint, replay_endpoint, topic, ...}``; earlier a bare array of
``{data_parallel_rank, endpoint, replay_endpoint, topic}``) or SGLang's / the mock's
``/server_info`` ``kv_events`` descriptor; the planned endpoints are the fallback. The agent reaches
a wildcard endpoint (``tcp://*:P``, ``tcp://0.0.0.0:P``) at 127.0.0.1 and advertises it at the
advertise host (the endpoint rules live in ``infera_common.kv_endpoints``, shared with the kv-indexer).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from infera_common.kv_endpoints import advertised_endpoint, local_endpoint, split_tcp
from infera_worker_agent.engine_cmd import EngineArgsError, flag_value, has_flag

__all__ = [  # advertised_endpoint and local_endpoint: re-exported, the agent's modules read them here
    "DP_FLAGS", "KV_EVENTS_FLAG", "VLLM_DEFAULT_BLOCK_SIZE", "KvEventsPlan", "KvSource", "advertised_endpoint",
    "block_size", "block_size_notes", "build_config", "config_publishes", "dp_size", "index_block_problem",
    "index_block_size", "local_endpoint", "offset_endpoint", "parse_json_flag", "plan_kv_events", "resolve_sources",
    "sources_from_config", "sources_from_descriptor", "sources_from_event_sources",
]

KV_EVENTS_FLAG = "--kv-events-config"
#: The engines' data-parallel size flags: SGLang ``--dp-size`` (alias ``--data-parallel-size``;
#: runbooks write ``--dp``, which argparse expands), vLLM ``--data-parallel-size`` / ``-dp``.
DP_FLAGS = {
    "sglang": ("--dp-size", "--data-parallel-size", "--dp"),
    "vllm": ("--data-parallel-size", "--dp-size", "-dp"),
    "mock": ("--dp-size", "--data-parallel-size", "--dp", "-dp"),
}
#: vLLM's default KV block size when neither /server_info nor ``--block-size`` says otherwise.
VLLM_DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class KvSource:
    """One DP rank's publisher: PUB endpoint and (optional) replay ROUTER endpoint."""

    dp_rank: int
    endpoint: str
    replay_endpoint: str | None = None


@dataclass(frozen=True, slots=True)
class KvEventsPlan:
    enabled: bool  # the engine will publish KV events
    extra_args: tuple[str, ...]  # appended to the engine command line
    sources: tuple[KvSource, ...]  # as configured (may name wildcard hosts or port 0)
    user_supplied: bool = False


def dp_size(engine: str, args: Sequence[str]) -> int:
    value = flag_value(args, *DP_FLAGS.get(engine, ("--dp-size",)))
    if value is None:
        return 1
    try:
        size = int(value)
    except ValueError:
        raise EngineArgsError(f"engine DP size {value!r} is not a number") from None
    if size < 1:
        raise EngineArgsError(f"engine DP size {size} must be at least 1")
    return size


def offset_endpoint(endpoint: str, rank: int) -> str:
    """The endpoint of DP rank ``rank``: the port plus the rank (port 0 stays 0), as the engines do."""
    parts = split_tcp(endpoint)
    if parts is None or rank == 0 or parts[1] == 0:
        return endpoint
    return f"tcp://{parts[0]}:{parts[1] + rank}"


def build_config(engine: str, port: int, replay_port: int) -> dict[str, Any]:
    config: dict[str, Any] = {
        "publisher": "zmq",
        "endpoint": f"tcp://*:{port}",
        "replay_endpoint": f"tcp://*:{replay_port}",
        "topic": "",
    }
    if engine in ("vllm", "mock"):  # the mock's vllm flavour needs it like vLLM; the sglang one ignores it
        config["enable_kv_cache_events"] = True
    return config


def parse_json_flag(flag: str, raw: str) -> dict[str, Any]:
    """An engine flag whose value is a JSON object (``--kv-events-config``, ``--kv-transfer-config``)."""
    try:
        config = json.loads(raw)
    except ValueError as exc:
        raise EngineArgsError(f"{flag} is not valid JSON ({exc}): {raw!r}") from None
    if not isinstance(config, dict):
        raise EngineArgsError(f"{flag} must be a JSON object, got {raw!r}")
    return config


def config_publishes(engine: str, config: dict[str, Any]) -> bool:
    publisher = config.get("publisher")
    if engine == "vllm":
        return bool(config.get("enable_kv_cache_events")) and publisher in (None, "zmq")
    if engine == "sglang":
        return publisher == "zmq"
    # the mock: either flavour's rule may apply; publishing if either engine would
    return publisher == "zmq" or (bool(config.get("enable_kv_cache_events")) and publisher is None)


def sources_from_config(config: dict[str, Any], dp: int) -> tuple[KvSource, ...]:
    endpoint = str(config.get("endpoint") or "tcp://*:5557")
    replay = config.get("replay_endpoint")
    return tuple(
        KvSource(r, offset_endpoint(endpoint, r), offset_endpoint(str(replay), r) if replay else None)
        for r in range(dp)
    )


def plan_kv_events(
    engine: str, args: Sequence[str], *, enabled: bool, find_ports: Callable[[int], int]
) -> KvEventsPlan:
    """What to add to the engine's command line for KV events, and the publishers it will run."""
    dp = dp_size(engine, args)
    if has_flag(args, KV_EVENTS_FLAG):
        config = parse_json_flag(KV_EVENTS_FLAG, flag_value(args, KV_EVENTS_FLAG) or "")
        publishes = config_publishes(engine, config)
        sources = sources_from_config(config, dp) if publishes else ()
        return KvEventsPlan(publishes, (), sources, user_supplied=True)
    if not enabled:
        return KvEventsPlan(False, (), ())
    port, replay_port = find_ports(dp), find_ports(dp)
    config = build_config(engine, port, replay_port)
    return KvEventsPlan(True, (KV_EVENTS_FLAG, json.dumps(config, separators=(",", ":"))),
                        sources_from_config(config, dp))


# --- after health: what the engine reports ------------------------------------------------------
def block_size(engine: str, server_info: dict[str, Any] | None, args: Sequence[str]) -> int | None:
    """The engine's resolved KV block size.

    SGLang and the mock report ``page_size`` in /server_info (the mock's vllm flavour also
    ``block_size``); real vLLM has no /server_info, so its ``--block-size`` (default 16) is used.
    """
    info = server_info or {}
    keys = ("block_size", "page_size") if engine == "vllm" else ("page_size", "block_size")
    for key in keys:
        value = info.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    flags = ("--block-size",) if engine == "vllm" else ("--page-size", "--block-size")
    value = flag_value(args, *flags)
    if value is not None and value.isdigit() and int(value) > 0:
        return int(value)
    return VLLM_DEFAULT_BLOCK_SIZE if engine == "vllm" else None


#: Below this index block size KV-aware routing still works, at a cost worth a warning (``small_block_note``).
SMALL_BLOCK_SIZE = 16
#: What ``--kv-index-block-size 0`` (the default) indexes a page smaller than ``SMALL_BLOCK_SIZE`` at
#: (the smallest multiple of the page at least this big).
AUTO_INDEX_BLOCK_SIZE = 16


def index_block_size(page: int | None, wanted: int) -> tuple[int | None, str | None]:
    """The worker's index block size (what the router hashes at and the index keeps) for the engine's
    page size ``page`` and ``--kv-index-block-size`` ``wanted`` (0: pick), and a note when ``wanted``
    had to change. Pages smaller than the index block are folded into it (``kv_coarse``)."""
    if page is None:
        return None, None
    if wanted == 0:
        return (page if page >= SMALL_BLOCK_SIZE else _multiple_at_least(page, AUTO_INDEX_BLOCK_SIZE)), None
    if wanted % page == 0:
        return wanted, None
    size = _multiple_at_least(page, wanted)
    return size, (f"--kv-index-block-size {wanted} is not a multiple of the engine's page size {page}: indexing at "
                  f"{size}; pass a multiple of {page} (or 0 to let the agent pick)")


def _multiple_at_least(page: int, size: int) -> int:
    return page * -(-size // page)


def index_block_problem(engine: str, wanted: int, args: Sequence[str]) -> str | None:
    """Before launch: ``--kv-index-block-size`` against a page size the engine's flags fix (vLLM's
    default 16 included), so that a runbook's mistake costs seconds, not a cold start."""
    if wanted == 0:
        return None
    page = block_size(engine, None, args)
    if page is None or wanted % page == 0:
        return None
    flags = ("--block-size",) if engine == "vllm" else ("--page-size", "--block-size")  # as ``block_size`` reads
    given = next((f"{flag} {flag_value(args, flag)}" for flag in flags if flag_value(args, flag) is not None), None)
    source = given or f"default {flags[0]} {page}"
    return (f"--kv-index-block-size {wanted} is not a multiple of the engine's page size ({source}): KV events "
            f"come in pages of {page} tokens, which fold only into index blocks of a multiple of {page}; pass "
            f"--kv-index-block-size {_multiple_at_least(page, wanted)} (or 0 to let the agent pick)")


def block_size_notes(page: int | None, wanted: int) -> list[tuple[str, str, dict[str, Any]]]:
    """What to tell the operator about the engine's page size ``page`` and the index block size it
    gives under ``--kv-index-block-size`` ``wanted``: (log level, event, fields) each."""
    index, changed = index_block_size(page, wanted)
    sizes: dict[str, Any] = {"block_size": page, "index_block_size": index}
    notes: list[tuple[str, str, dict[str, Any]]] = []
    if changed is not None:
        notes.append(("warning", "kv_index_block_size_changed", {**sizes, "hint": changed}))
    elif page is not None and index != page:
        notes.append(("info", "kv_pages_folded", {**sizes, "note": "the engine's pages are indexed in blocks of "
                                                  "index_block_size tokens (--kv-index-block-size)"}))
    small = small_block_note(index)
    if small is not None:
        notes.append(("warning", "kv_block_size_small", {**sizes, "hint": small}))
    return notes


def small_block_note(size: int | None) -> str | None:
    """What to tell the operator when the worker is indexed at a small block size (its engine's page,
    ``--kv-index-block-size`` set to it): each block is one relayed hash, one router hash per request
    and one index entry per cached block, so a block of 1 costs all of them per token."""
    if size is None or size >= SMALL_BLOCK_SIZE:
        return None
    return (f"the worker's KV index block size is {size}: KV-aware routing relays, hashes and indexes one block per "
            f"{size} token(s), e.g. {16384 // size:,} hashes and index entries for a 16k-token prompt; leave "
            f"--kv-index-block-size at 0 (or give a multiple of the engine's page size of {SMALL_BLOCK_SIZE} or more) "
            f"to fold the engine's pages into larger index blocks")


def sources_from_event_sources(data: Any) -> tuple[KvSource, ...]:
    """vLLM ``GET /kv_event_sources``: ``[{data_parallel_rank, endpoint, replay_endpoint, topic}]``, or
    (vLLM 0.32) the same entries in a map keyed by DP rank: ``{"0": {endpoint, replay_endpoint, ...}}``."""
    if isinstance(data, dict):
        ranked = []
        for key, item in data.items():
            if isinstance(item, dict) and str(key).isdigit():
                ranked.append({"data_parallel_rank": int(key), **item})
        data = sorted(ranked, key=lambda item: item["data_parallel_rank"])
    if not isinstance(data, list):
        return ()
    out = []
    for i, item in enumerate(data):
        if not isinstance(item, dict) or not isinstance(item.get("endpoint"), str):
            continue
        rank = item.get("data_parallel_rank")
        replay = item.get("replay_endpoint")
        out.append(KvSource(rank if isinstance(rank, int) else i, item["endpoint"],
                            replay if isinstance(replay, str) and replay else None))
    return tuple(out)


def sources_from_descriptor(desc: Any, planned: Sequence[KvSource]) -> tuple[KvSource, ...]:
    """SGLang / mock ``/server_info`` ``kv_events``: host + port base (+ the mock's resolved endpoints)."""
    if not isinstance(desc, dict):
        return ()
    dp = desc.get("dp_size") if isinstance(desc.get("dp_size"), int) and desc["dp_size"] > 0 else max(len(planned), 1)
    planned_replay = {s.dp_rank: s.replay_endpoint for s in planned}
    endpoints = desc.get("endpoints")
    if isinstance(endpoints, list) and endpoints and all(isinstance(e, str) for e in endpoints):
        pubs = list(endpoints)
    elif isinstance(desc.get("endpoint_port_base"), int):
        host = desc.get("endpoint_host") or "*"
        pubs = [f"tcp://{host}:{desc['endpoint_port_base'] + r}" for r in range(dp)]
    else:
        return ()
    replay_base = desc.get("replay_endpoint_port_base")
    replay_host = "*"
    if isinstance(desc.get("replay_endpoint"), str) and (parts := split_tcp(desc["replay_endpoint"])):
        replay_host = parts[0]
    sources = []
    for r, pub in enumerate(pubs):
        if isinstance(replay_base, int) and replay_base > 0:
            replay = f"tcp://{replay_host}:{replay_base + r}"
        else:
            replay = planned_replay.get(r)
        sources.append(KvSource(r, pub, replay))
    return tuple(sources)


def resolve_sources(
    planned: Sequence[KvSource], event_sources: Any = None, server_info: dict[str, Any] | None = None
) -> tuple[KvSource, ...]:
    """The publishers actually bound: /kv_event_sources, else /server_info kv_events, else the plan."""
    return (
        sources_from_event_sources(event_sources)
        or sources_from_descriptor((server_info or {}).get("kv_events"), planned)
        or tuple(planned)
    )
