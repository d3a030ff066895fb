"""Mistyped names, caught at start (pure): an agent flag that would go to the engine, and an
``INFERA_*`` environment variable that would be ignored.

Flags. Every argument the agent does not declare is the engine's, passed on verbatim: so
``--discovery-backnd etcd`` used to reach the engine, and the agent ran on its default plane (the
mock engine ignores flags it does not know; a real engine fails only after its imports, or never,
when the mistyped name happens to be one of its own). An engine argument whose name, with ``_``
read as ``-``, is an agent flag, or within ``CUTOFF`` of one (``difflib``'s ratio), is refused with
the flag it most likely meant. The cutoff sits above every flag of SGLang 0.5.19, vLLM 0.32 and the
mock engine (closest: SGLang's and vLLM's ``--load-format`` to ``--log-format``, 0.88; the slow
tiers check it against each engine's own parser), and below one- or two-letter slips in the
agent's flags (0.90 and up). A flag meant for the engine as written goes after ``--``.

Environment. pydantic-settings ignores a variable no field names, so ``INFERA_ROUTER_POLCY=...``
left the router on its default policy without a word. A variable with the program's prefix that
is none of its settings but within ``CUTOFF`` of one (the part after the prefix, case ignored, as
pydantic-settings reads names), or one slip away from a short one, is refused with the name it
most likely meant. One letter changed, added, dropped or swapped with its neighbour in a name of
``n`` letters gives a ratio of at least (n - 1) / n: 0.75 for ``PORT`` or ``ROLE``, below
``CUTOFF`` for every name under ten letters (``INFERA_ROEL``, ``INFERA_PROT`` went unnoticed until
session 24); two slips in a short name stay below it. Variables of other
Infera programs are left alone: one environment often serves a whole fleet (compose, ``infera
up``), and a test checks that no program's variable comes within ``CUTOFF`` of another program's.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Iterable

CUTOFF = 0.9


def _closest(name: str, known: Iterable[str]) -> str | None:
    found = difflib.get_close_matches(name, sorted(known), n=1, cutoff=CUTOFF)
    return found[0] if found else None


def _one_slip(name: str, known: Iterable[str]) -> str | None:
    """The closest of ``known`` that ``name`` is within ``CUTOFF`` of, or one slip away from."""
    best, best_ratio = None, 0.0
    matcher = difflib.SequenceMatcher(b=name)
    for candidate in sorted(known):
        matcher.set_seq1(candidate)
        ratio = matcher.ratio()
        if ratio >= min(CUTOFF, (len(candidate) - 1) / len(candidate)) and ratio > best_ratio:
            best, best_ratio = candidate, ratio
    return best


def near_misses(engine_args: Iterable[str], agent_flags: Iterable[str]) -> list[str]:
    """One message per engine argument that looks like a mistyped agent flag."""
    own = list(agent_flags)
    problems = []
    for arg in engine_args:
        if not arg.startswith("--") or arg == "--":
            continue
        name = arg.split("=", 1)[0]
        meant = _closest(name.replace("_", "-"), own)
        if meant:
            problems.append(f"{name} is not a flag of the agent, and would go to the engine as written: did you mean "
                            f"{meant}? (to give the engine {name} as written, put it after `--`)")
    return problems


def env_near_misses(environ: Iterable[str], known: Collection[str], prefix: str, program: str) -> list[str]:
    """One message per variable in ``environ`` (names) with ``prefix`` that is not in ``known`` (full
    names, upper case) but looks like a mistyped one of them."""
    prefix = prefix.upper()
    tails = {name[len(prefix):]: name for name in known if name.startswith(prefix)}
    problems = []
    for var in environ:
        upper = var.upper()
        if not upper.startswith(prefix) or upper in known:
            continue
        meant = _one_slip(upper[len(prefix):], tails)
        if meant:
            problems.append(f"environment variable {var} is not a setting of {program}, and would be ignored: "
                            f"did you mean {tails[meant]}?")
    return problems
