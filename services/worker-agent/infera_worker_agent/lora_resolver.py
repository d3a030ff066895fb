"""Adapters a vLLM engine loads when a request first names them: its filesystem LoRA resolver.

vLLM 0.32 (``vllm/plugins/lora_resolvers/filesystem_resolver.py``, ``entrypoints/serve/engine``):
with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` true (``1`` or ``true``) and ``VLLM_LORA_RESOLVER_CACHE_DIR``
set, the ``lora_filesystem_resolver`` general plugin (loaded unless ``VLLM_PLUGINS`` lists plugins
without it) answers a request whose ``model`` is no served name: ``<dir>/<model>/adapter_config.json``
with ``peft_type`` ``LORA`` and ``base_model_name_or_path`` equal to the engine's model (its
``--model``, ``root`` in ``/v1/models``) is loaded under that name, and the request runs under it.
Such an adapter is not in ``/v1/models`` until then, so the fleet would never route a request for it
here: the worker-agent lists the directory as the resolver would read it and registers those
adapters too (``NamesWatch``, every ``--models-interval``). Needs ``--enable-lora`` (without it vLLM
finds the adapter and fails to load it).

``resolver_dir`` and ``with_adapters`` are pure; ``adapters_in`` reads the directory.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from infera_worker_agent.health import ModelCard

RUNTIME_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
DIR_ENV = "VLLM_LORA_RESOLVER_CACHE_DIR"
PLUGINS_ENV = "VLLM_PLUGINS"
PLUGIN = "lora_filesystem_resolver"
CONFIG = "adapter_config.json"
_TRUE = ("1", "true")


def lora_enabled(engine_args: Sequence[str]) -> bool:
    """Whether vLLM's command line turns LoRA on (``--enable-lora``, last one wins)."""
    enabled = False
    for raw in engine_args:
        flag, sep, value = raw.partition("=")
        arg = flag.replace("_", "-") + sep + value  # vLLM's parser takes --enable_lora too
        if arg == "--enable-lora":
            enabled = True
        elif arg == "--no-enable-lora":
            enabled = False
        elif arg.startswith("--enable-lora="):
            enabled = arg.split("=", 1)[1].strip().lower() in (*_TRUE, "yes")
    return enabled


def resolver_dir(family: str, env: Mapping[str, str], engine_args: Sequence[str]) -> str | None:
    """The directory a vLLM engine resolves unknown adapter names from (None: it resolves none)."""
    if family != "vllm" or env.get(RUNTIME_ENV, "0").strip().lower() not in _TRUE:
        return None
    directory = env.get(DIR_ENV)
    plugins = env.get(PLUGINS_ENV)
    if not directory or (plugins is not None and PLUGIN not in plugins.split(",")):
        return None
    return directory if lora_enabled(engine_args) else None


def adapters_in(directory: str, base_model: str | None) -> tuple[str, ...]:
    """The adapters the resolver would load for ``base_model`` (the engine's ``root``), by name."""
    if not base_model:
        return ()
    try:
        entries = sorted(e.name for e in os.scandir(directory) if e.is_dir())
    except OSError:
        return ()
    found = []
    for name in entries:
        try:
            config = json.loads((Path(directory) / name / CONFIG).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(config, dict) and config.get("peft_type") == "LORA" \
                and config.get("base_model_name_or_path") == base_model:
            found.append(name)
    return tuple(found)


def with_adapters(card: ModelCard, resolvable: Sequence[str]) -> ModelCard:
    """``card`` with the resolvable adapters after those the engine lists (not its own names)."""
    own = {card.id, *card.aliases, *card.adapters}
    extra = tuple(name for name in resolvable if name not in own)
    return replace(card, adapters=card.adapters + extra) if extra else card
