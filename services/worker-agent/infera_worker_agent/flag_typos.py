"""A mistyped agent flag, caught before it goes to the engine (pure).

Every argument the agent does not declare is the engine's, passed on verbatim: so
``--discovery-backnd etcd`` used to reach the engine, and the agent ran on its default plane (the
mock engine ignores flags it does not know; a real engine fails only after its imports, or never,
when the mistyped name happens to be one of its own). An engine argument whose name, with ``_``
read as ``-``, is an agent flag, or within ``CUTOFF`` of one (``difflib``'s ratio), is refused with
the flag it most likely meant. The cutoff sits above every flag of SGLang 0.5.19, vLLM 0.32 and the
mock engine (closest: SGLang's and vLLM's ``--load-format`` to ``--log-format``, 0.88; the slow
tiers check it against each engine's own parser), and below one- or two-letter slips in the
agent's flags (0.90 and up). A flag meant for the engine as written goes after ``--``.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

CUTOFF = 0.9


def near_misses(engine_args: Iterable[str], agent_flags: Iterable[str]) -> list[str]:
    """One message per engine argument that looks like a mistyped agent flag."""
    own = sorted(agent_flags)
    problems = []
    for arg in engine_args:
        if not arg.startswith("--") or arg == "--":
            continue
        name = arg.split("=", 1)[0]
        meant = difflib.get_close_matches(name.replace("_", "-"), own, n=1, cutoff=CUTOFF)
        if meant:
            problems.append(f"{name} is not a flag of the agent, and would go to the engine as written: did you mean "
                            f"{meant[0]}? (to give the engine {name} as written, put it after `--`)")
    return problems
