"""Whether the interpreter that launches the engine can run it: decided over ``HostFacts`` (pure).

Without this, a launch on an interpreter that lacks the engine fails only as the engine process
starts, with Python's own "No module named ..." (or, for an ``--engine-python`` that is not there,
a traceback of the spawn naming no file), and nothing says which flag to change.
"""

from __future__ import annotations

from infera_worker_agent.engine_cmd import LAUNCH_MODULES
from infera_worker_agent.host_probe import HostFacts

ENGINE_NAMES = {"sglang": "SGLang", "vllm": "vLLM", "mock": "the mock engine (Infera's)"}


def install_problem(engine: str, python: str, host: HostFacts, *, named: bool) -> str | None:
    """Why ``python`` cannot launch ``engine``, naming what to change; None when it can or nobody
    asked it (the mock engine under the agent's own interpreter, whose install holds it).
    ``named``: the interpreter came from ``--engine-python``."""
    name = ENGINE_NAMES[engine]
    where = "--engine-python" if named else "the agent's own interpreter"
    if host.interpreter_error is not None:
        return (f"{where} {python} cannot be run ({host.interpreter_error}): give --engine-python the path "
                f"of a Python interpreter that has {name} installed")
    if host.launch_modules is None or any(m in host.launch_modules for m in LAUNCH_MODULES[engine]):
        return None
    fix = ("install it there, or point --engine-python (INFERA_ENGINE_PYTHON) at the interpreter of the "
           f"environment that has {name}")
    return f"{name} is not installed for {where} {python} (no module {LAUNCH_MODULES[engine][-1]}): {fix}"
