"""LoRA adapters, as the engine of each flavour takes them on its command line (pure, no I/O).

The mock loads no weights: an adapter is a name (what a request gives as ``model``) and a path
(reported, never read). What it changes is what a real engine's adapter changes for a router: the
KV blocks a request under it computes are its own (the cache chains them from the adapter's root,
and the KV events name it), and ``/v1/models`` lists it with its base model as ``parent``.

vLLM 0.32: ``--enable-lora --lora-modules name=path '{"name": ..., "path": ...,
"base_model_name": ...}' ...``; numbered from 1 in the order given (its ``lora_int_id``); a request
names one by ``model``. With ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` set it also loads and unloads
adapters while it serves (``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}``, ``POST
/v1/unload_lora_adapter`` ``{"lora_name"}``); a loaded adapter takes the next number.

SGLang 0.5.23: ``--lora-paths PATH | NAME=PATH | '{"lora_name": ..., "lora_path": ...}' ...``
(``--enable-lora`` is implied); an OpenAI request names an adapter after a served name (``"model":
"<served>:<adapter>"``; a bare adapter name is not one, and the base model runs it); its KV events
carry ``lora_name`` with ``lora_id`` None. ``POST /load_lora_adapter`` and ``/unload_lora_adapter``
are always served; a request naming an adapter loaded before and unloaded since loads it again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from infera_mock_engine.kv_events import Adapter


class LoraConfigError(ValueError):
    """A LoRA flag the engine of this flavour would refuse (the message names the flag)."""


@dataclass(frozen=True)
class LoraModule:
    """One adapter: the name requests give, its path, and the base model it was trained on (None:
    the engine's first served name)."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_vllm_modules(values: list[str]) -> tuple[LoraModule, ...]:
    """vLLM's ``--lora-modules`` values: ``name=path`` (no comma), or a JSON object with ``name``,
    ``path`` and optionally ``base_model_name``."""
    out: list[LoraModule] = []
    for item in values:
        if not item:
            continue
        if "=" in item and "," not in item:
            name, path = item.split("=", 1)
            out.append(LoraModule(name, path))
            continue
        try:
            spec = json.loads(item)
        except ValueError:
            raise LoraConfigError(f"Invalid JSON format for --lora-modules: {item}") from None
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) \
                or not isinstance(spec.get("path"), str) or set(spec) - {"name", "path", "base_model_name"}:
            raise LoraConfigError(f"Invalid fields for --lora-modules: {item} - give name, path and optionally "
                                  "base_model_name")
        out.append(LoraModule(spec["name"], spec["path"], spec.get("base_model_name")))
    return tuple(out)


def parse_sglang_paths(values: list[str]) -> tuple[LoraModule, ...]:
    """SGLang's ``--lora-paths`` values: ``PATH`` (named by it), ``NAME=PATH``, or a JSON object with
    ``lora_name`` and ``lora_path`` (and ``pinned``, accepted)."""
    out: list[LoraModule] = []
    for item in values:
        if item.lstrip().startswith("{"):
            try:
                spec = json.loads(item)
            except ValueError:
                raise LoraConfigError(f"--lora-paths: invalid JSON {item!r}") from None
            if not isinstance(spec, dict) or not isinstance(spec.get("lora_name"), str) \
                    or not isinstance(spec.get("lora_path"), str):
                raise LoraConfigError(f"--lora-paths: {item!r} needs lora_name and lora_path")
            out.append(LoraModule(spec["lora_name"], spec["lora_path"]))
        elif "=" in item:
            name, path = item.split("=", 1)
            out.append(LoraModule(name, path))
        elif item:
            out.append(LoraModule(item, item))
    return tuple(out)


def requested(flavor: str, model: str | None, served: tuple[str, ...]) -> tuple[str | None, bool]:
    """The adapter a request's ``model`` asks for in this flavour, and whether it asks for one at all:
    vLLM by its name (any name not served); SGLang after a served name (``base:adapter``), a served
    name winning as a whole."""
    if not model or model in served:
        return None, False
    if flavor == "vllm":
        return model, True
    base, sep, name = model.partition(":")
    if sep and base in served:
        return name, True
    return None, False  # SGLang: not an adapter; its base model runs the request


def check(modules: tuple[LoraModule, ...], enabled: bool, served: tuple[str, ...], flag: str) -> None:
    """Refuse what the engine would refuse at start: adapters without ``--enable-lora``, a name given
    twice, or one that is also a served model name."""
    if modules and not enabled:
        raise LoraConfigError(f"{flag} needs --enable-lora")
    try:
        LoraRegistry(modules, served, enabled)
    except LoraConfigError as e:
        raise LoraConfigError(f"{flag}: {e}") from None


class LoraRegistry:
    """The adapters an engine serves now: those of its command line, then those loaded at run time."""

    def __init__(self, modules: tuple[LoraModule, ...], served: tuple[str, ...], enabled: bool) -> None:
        self._served = served
        self.enabled = enabled
        self._loaded: dict[str, tuple[LoraModule, Adapter]] = {}
        self._seen: dict[str, LoraModule] = {}  # every adapter ever loaded (SGLang's reference cache)
        self._next = 1
        for m in modules:
            self.load(m.name, m.path, m.base_model_name)

    def get(self, name: str | None) -> Adapter | None:
        """The adapter a request's ``model`` names (None: not an adapter)."""
        held = self._loaded.get(name) if name else None
        return held[1] if held else None

    def modules(self) -> list[LoraModule]:
        """The adapters served, in the order they were loaded."""
        return [m for m, _ in self._loaded.values()]

    def load(self, name: str, path: str, base_model_name: str | None = None, again: bool = False) -> None:
        """Serve one more adapter (``LoraConfigError``: what vLLM refuses, with its message); ``again``:
        SGLang loading one it evicted or unloaded, whose KV is keyed afresh (a new id per load)."""
        if not self.enabled:
            raise LoraConfigError("LoRA is not enabled: start the engine with --enable-lora")
        if not name or not path:
            raise LoraConfigError("Both 'lora_name' and 'lora_path' must be provided.")
        if name in self._served:
            raise LoraConfigError(f"The lora adapter '{name}' conflicts with a served base model.")
        if name in self._loaded:
            raise LoraConfigError(f"The lora adapter '{name}' has already been loaded.")
        module = self._seen[name] = LoraModule(name, path, base_model_name)
        key = f"{name}\x00{path}" + (f"\x00{self._next}" if again else "")
        self._loaded[name] = (module, Adapter(self._next, name, key))
        self._next += 1

    def reload(self, name: str) -> Adapter | None:
        """Load again an adapter loaded before (SGLang does so for a request that names one it evicted
        or unloaded); None when it never was."""
        module = self._seen.get(name)
        if module is None:
            return None
        if name not in self._loaded:
            self.load(module.name, module.path, module.base_model_name, again=True)
        return self.get(name)

    def unload(self, name: str) -> bool:
        """Stop serving an adapter; False when none has that name."""
        return self._loaded.pop(name, None) is not None
