"""Whether the model and tokenizer paths in the engine arguments are there, checked before the
engine's cold start. ``path_problems`` decides (pure, over what ``look`` finds); ``look_path`` is
the only I/O.

SGLang and vLLM do not look at a model path until their imports and start-up have run (tens of
seconds to minutes on a GPU host), and then take a path that is not there for a Hugging Face repo
id and fail on that. A directory that holds no model (the folder above the model, a common slip
in a runbook) fails as late. Only names that cannot be repo ids are checked: absolute paths and
``./`` or ``../`` ones; ``org/name`` may be a repo id the engine downloads. The mock engine checks
its own model path at once, as it starts, so it is left to do so.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from infera_worker_agent.engine_cmd import flag_value, has_flag, vllm_flag_view

#: the engine flags that name the model, then the tokenizer (SGLang's ``--model`` is ``--model-path``)
MODEL_FLAGS = {"sglang": ("--model-path", "--model"), "vllm": ("--model",)}
TOKENIZER_FLAGS = {"sglang": ("--tokenizer-path",), "vllm": ("--tokenizer",)}
#: a model directory holds one of these: a Hugging Face config, Mistral's own format
#: (vLLM ``--config-format mistral``), a diffusers pipeline
CONFIG_FILES = ("config.json", "params.json", "model_index.json")
#: models named in a hint, at most
HINTS = 4


@dataclass(frozen=True, slots=True)
class PathLook:
    """What is at a path: nothing, a file (a GGUF model is one), or a directory and whether it holds a
    model's config (``models_inside``: its subdirectories that do)."""

    exists: bool
    is_dir: bool = False
    has_config: bool = False
    models_inside: tuple[str, ...] = ()


def local_only(name: str) -> bool:
    """A name no engine would take for a Hugging Face repo id."""
    return name.startswith(("/", "./", "../"))


def look_path(path: str) -> PathLook:
    p = Path(path)
    try:
        if not p.exists():
            return PathLook(exists=False)
        if not p.is_dir():
            return PathLook(exists=True)
        if any((p / name).is_file() for name in CONFIG_FILES):
            return PathLook(exists=True, is_dir=True, has_config=True)
        inside = sorted(str(d) for d in p.iterdir() if d.is_dir() and (d / CONFIG_FILES[0]).is_file())
    except OSError:  # unreadable: the engine will say what it makes of it
        return PathLook(exists=True)
    return PathLook(exists=True, is_dir=True, models_inside=tuple(inside))


def path_problems(engine: str, engine_args: Sequence[str], look: Callable[[str], PathLook] = look_path) -> list[str]:
    """The model or tokenizer paths that cannot work, each as a message naming the flag."""
    if engine not in MODEL_FLAGS:
        return []
    args = vllm_flag_view(engine_args) if engine == "vllm" else list(engine_args)
    problems = []
    model_flags = MODEL_FLAGS[engine]
    model = flag_value(args, *model_flags)
    if model is not None and local_only(model):
        found = look(model)
        flag = _given(args, model_flags)
        # vLLM reads the config from --hf-config-path when given: then the directory may hold none
        needs_config = not (engine == "vllm" and has_flag(args, "--hf-config-path"))
        if not found.exists:
            problems.append(f"the engine argument {flag} {model} does not exist on this host: pass the model's "
                            f"directory (the engine would take it for a Hugging Face repo id, and fail, only after "
                            f"its start-up)")
        elif found.is_dir and not found.has_config and needs_config:
            hint = (f"; the model directories in it: {', '.join(found.models_inside[:HINTS])}"
                    f"{' …' if len(found.models_inside) > HINTS else ''}" if found.models_inside else "")
            problems.append(f"the engine argument {flag} {model} is a directory without a model's config.json: "
                            f"pass the directory of the model itself{hint}")
    tokenizer_flags = TOKENIZER_FLAGS[engine]
    tokenizer = flag_value(args, *tokenizer_flags)
    if tokenizer is not None and local_only(tokenizer) and not look(tokenizer).exists:
        problems.append(f"the engine argument {_given(args, tokenizer_flags)} {tokenizer} does not exist on this "
                        f"host: pass the tokenizer's directory, or leave the flag out to use the model's")
    return problems


def _given(args: Sequence[str], names: Sequence[str]) -> str:
    """Which of the flag's names the arguments used last (as the user wrote it)."""
    used = names[0]
    for arg in args:
        for name in names:
            if arg == name or arg.startswith(name + "="):
                used = name
    return used
