"""``infera-router`` / ``python -m infera_router``: settings, logging, metrics endpoint, signals."""

from __future__ import annotations

import sys

from infera_common.runtime import service_main

from infera_router.service import RouterService
from infera_router.settings import RouterSettings

DESCRIPTION = (
    "Infera router: follows the worker fleet in discovery, picks a worker for each request "
    "(NATS request/reply), hands the work to the worker's queue and accounts its load."
)


def main(argv: list[str] | None = None) -> None:
    service_main(argv, RouterSettings, RouterService, name="router", prog="infera-router", description=DESCRIPTION)


if __name__ == "__main__":
    main(sys.argv[1:])
