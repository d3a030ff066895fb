"""``infera-router`` / ``python -m infera_router``: settings, logging, metrics endpoint, signals."""

from __future__ import annotations

import sys

from infera_common.logs import configure_logging
from infera_common.runtime import event_loop_runner, run_service
from infera_common.settings import parse_cli

from infera_router.service import RouterService
from infera_router.settings import RouterSettings

DESCRIPTION = (
    "Infera router: follows the worker fleet in discovery, picks a worker for each request "
    "(NATS request/reply), hands the work to the worker's queue and accounts its load."
)


async def run(settings: RouterSettings) -> None:
    log = configure_logging(settings.log_level, settings.log_format, "router")
    await run_service(RouterService(settings), name="router", metrics_host=settings.metrics_host,
                      metrics_port=settings.metrics_port, log=log)


def main(argv: list[str] | None = None) -> None:
    settings, _ = parse_cli(RouterSettings, argv, prog="infera-router", description=DESCRIPTION)
    settings.require_supported()
    with event_loop_runner() as runner:
        runner.run(run(settings))


if __name__ == "__main__":
    main(sys.argv[1:])
