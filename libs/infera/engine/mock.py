"""``python -m infera.engine.mock …`` = ``infera-worker-agent --engine mock …`` (see ``infera.engine``)."""

from __future__ import annotations

from infera.engine import run


def main() -> int:
    return run("mock")


if __name__ == "__main__":
    raise SystemExit(main())
