"""``python -m infera.engine.sglang …`` = ``infera-worker-agent --engine sglang …`` (see ``infera.engine``)."""

from __future__ import annotations

from infera.engine import run


def main() -> int:
    return run("sglang")


if __name__ == "__main__":
    raise SystemExit(main())
