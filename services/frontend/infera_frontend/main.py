"""`infera-frontend` / `python -m infera_frontend`: the OpenAI-compatible entry point of an Infera fleet.

Serves the OpenAI HTTP API (and the same API on NATS request/reply), validates and tokenizes each
request, asks the router where it runs, and relays the worker's response frames back to the client.
"""

from __future__ import annotations

import asyncio
import signal
import sys

from infera_common.logs import configure_logging
from infera_common.runtime import event_loop_runner
from infera_common.settings import parse_cli

from infera_frontend.service import Frontend
from infera_frontend.settings import FrontendSettings


async def serve(settings: FrontendSettings) -> int:
    frontend = Frontend(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await frontend.start()
    except Exception as exc:  # NATS unreachable, JetStream off, port taken, bad tokenizer, ...
        print(f"infera-frontend: cannot start: {exc}", file=sys.stderr)
        await frontend.stop()
        return 1
    try:
        await stop.wait()
    finally:
        await frontend.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    settings, _ = parse_cli(FrontendSettings, argv, prog="infera-frontend", description=__doc__)
    configure_logging(settings.log_level, settings.log_format, service="frontend")
    with event_loop_runner() as runner:
        return runner.run(serve(settings))


if __name__ == "__main__":
    raise SystemExit(main())
