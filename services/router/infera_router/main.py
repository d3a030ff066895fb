"""``infera-router`` / ``python -m infera_router``: settings, logging, metrics endpoint, signals."""

from __future__ import annotations

import asyncio
import signal
import sys

from infera_common.logs import configure_logging
from infera_common.metrics import start_metrics_server
from infera_common.runtime import event_loop_runner
from infera_common.settings import parse_cli

from infera_router.service import RouterService
from infera_router.settings import RouterSettings

DESCRIPTION = (
    "Infera router: follows the worker fleet in discovery, picks a worker for each request "
    "(NATS request/reply), hands the work to the worker's queue and accounts its load."
)


async def run(settings: RouterSettings) -> None:
    log = configure_logging(settings.log_level, settings.log_format, "router")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    service = RouterService(settings)
    try:
        runner, port = await start_metrics_server(service.metrics.registry, settings.metrics_host, settings.metrics_port)
    except OSError as exc:
        raise SystemExit(
            f"error: cannot serve metrics on {settings.metrics_host}:{settings.metrics_port} ({exc}); "
            f"pass --metrics-port (0 = any free port)"
        ) from exc
    log.info("metrics_serving", host=settings.metrics_host, port=port)
    try:
        starting = asyncio.create_task(service.start())
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():  # a signal during start-up
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
        else:
            try:
                starting.result()
            except ConnectionError as exc:
                raise SystemExit(f"error: {exc}") from exc
            await stopping
        stopping.cancel()
        log.info("router_stopping")
    finally:
        await service.stop()
        await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    settings, _ = parse_cli(RouterSettings, argv, prog="infera-router", description=DESCRIPTION)
    settings.require_supported()
    with event_loop_runner() as runner:
        runner.run(run(settings))


if __name__ == "__main__":
    main(sys.argv[1:])
