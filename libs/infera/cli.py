"""The `infera` command: `infera up` starts the default local fleet."""

from __future__ import annotations

import sys

USAGE = """usage: infera <command> [options]

commands:
  up      start nats-server, router, frontend and mock workers locally (infera up --help)
"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "up":
        from infera.up import main as up_main

        return up_main(rest)
    print(f"infera: unknown command {command!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
