"""One thing a probe found, and the rules that roll findings up. Pure."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Level = Literal["info", "warn", "fail"]
LEVELS: tuple[Level, ...] = ("info", "warn", "fail")


@dataclass(frozen=True, slots=True)
class Finding:
    level: Level
    message: str
    details: dict[str, Any] = field(default_factory=dict)


def worst(findings: list[Finding]) -> Level:
    """The most serious level among ``findings`` (``info`` when there are none)."""
    return max((f.level for f in findings), key=LEVELS.index, default="info")


def worst_of(sections: dict[str, list[Finding]]) -> Level:
    """The most serious level in a host's sections."""
    return worst([f for found in sections.values() for f in found])


def skipped(what: str, why: str) -> Finding:
    """A probe that could not measure here: said, never a failure of the node."""
    return Finding("info", f"{what}: not measured ({why})")
