"""``python -m infera.engine.vllm …`` = ``infera-worker-agent --engine vllm …`` (see ``infera.engine``)."""

from __future__ import annotations

from infera.engine import run


def main() -> int:
    return run("vllm")


if __name__ == "__main__":
    raise SystemExit(main())
