"""KV cache events as the cache produces them (flavour-neutral; `event_wire.py` encodes them).

Block hashes here are the engine's own opaque values (`block_hasher.py`): vLLM-style unsigned or
SGLang-style signed 64-bit integers, never a contract with the consumer.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Adapter:
    """A LoRA adapter the engine serves: its number (vLLM's ``lora_int_id``, from 1), its name, and
    what its KV blocks are keyed by in the cache besides their tokens (``cache_key``: vLLM hashes the
    name and path; SGLang a fresh id each time it loads an adapter again)."""

    id: int
    name: str
    cache_key: str = ""


@dataclass(frozen=True, slots=True)
class BlockStored:
    """`n` consecutive full blocks of one sequence entered the cache."""

    block_hashes: list[int]
    parent_block_hash: int | None  # the block before the first of these; None for a sequence's first block
    token_ids: list[int]  # n * block_size ids
    block_size: int
    lora: Adapter | None = None  # the LoRA adapter that computed them (None: the base model)
    cache_salt: str | None = None  # the salt of the request that computed them


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Cached blocks were evicted."""

    block_hashes: list[int]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole prefix cache was flushed."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared
