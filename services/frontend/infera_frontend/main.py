"""`infera-frontend` / `python -m infera_frontend`: the OpenAI-compatible entry point of an Infera fleet.

Serves the OpenAI HTTP API (and the same API on NATS request/reply), validates and tokenizes each
request, asks the router where it runs, and relays the worker's response frames back to the client.
"""

from __future__ import annotations

from infera_common.runtime import configure_observability, event_loop_runner, run_until_signal
from infera_common.settings import parse_cli

from infera_frontend.service import Frontend
from infera_frontend.settings import FrontendSettings


def main(argv: list[str] | None = None) -> int:
    settings, _ = parse_cli(FrontendSettings, argv, prog="infera-frontend", description=__doc__)
    configure_observability(settings, "frontend")
    with event_loop_runner() as runner:
        return runner.run(run_until_signal(Frontend(settings), name="infera-frontend"))


if __name__ == "__main__":
    raise SystemExit(main())
