"""Reading ``/proc`` and ``/sys`` files: a value, or None when it is not there or unreadable."""

from __future__ import annotations

from pathlib import Path


def read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def sorted_dirs(path: Path) -> list[Path]:
    """The directories in ``path`` (symlinks to directories included), in natural order; [] when none."""
    try:
        return sorted((p for p in path.iterdir() if p.is_dir()), key=lambda p: _natural(p.name))
    except OSError:
        return []


def _natural(name: str) -> tuple:
    """mlx5_2 before mlx5_10."""
    head = name.rstrip("0123456789")
    tail = name[len(head):]
    return (head, int(tail) if tail else -1, name)
