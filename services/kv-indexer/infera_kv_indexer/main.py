"""``infera-kv-indexer`` / ``python -m infera_kv_indexer``: settings, logging, metrics endpoint, signals."""

from __future__ import annotations

import asyncio
import signal
import sys

from infera_common.logs import configure_logging
from infera_common.metrics import start_metrics_server
from infera_common.runtime import event_loop_runner
from infera_common.settings import parse_cli

from infera_kv_indexer.service import KvIndexerService
from infera_kv_indexer.settings import KvIndexerSettings

DESCRIPTION = (
    "Infera kv-indexer: replays and follows the engines' KV events from JetStream into a prefix index "
    "per model, and answers overlap queries (NATS request/reply) with each worker's cached prefix depth."
)


async def run(settings: KvIndexerSettings) -> None:
    log = configure_logging(settings.log_level, settings.log_format, "kv-indexer")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    service = KvIndexerService(settings)
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
        if not starting.done():  # a signal during start-up (or replay)
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
        else:
            try:
                starting.result()
            except ConnectionError as exc:
                raise SystemExit(f"error: {exc}") from exc
            except Exception as exc:  # e.g. JetStream disabled on the server
                log.exception("start_failed")
                raise SystemExit(f"error: kv-indexer could not start: {type(exc).__name__}: {exc}") from exc
            await stopping
        stopping.cancel()
        log.info("kv_indexer_stopping")
    finally:
        await service.stop()
        await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    settings, _ = parse_cli(KvIndexerSettings, argv, prog="infera-kv-indexer", description=DESCRIPTION)
    settings.require_supported()
    with event_loop_runner() as runner:
        runner.run(run(settings))


if __name__ == "__main__":
    main(sys.argv[1:])
