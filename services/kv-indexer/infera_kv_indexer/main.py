"""``infera-kv-indexer`` / ``python -m infera_kv_indexer``: settings, logging, metrics endpoint, signals."""

from __future__ import annotations

import sys

from infera_common.logs import configure_logging
from infera_common.runtime import event_loop_runner, run_service
from infera_common.settings import parse_cli

from infera_kv_indexer.service import KvIndexerService
from infera_kv_indexer.settings import KvIndexerSettings

DESCRIPTION = (
    "Infera kv-indexer: replays and follows the engines' KV events from JetStream into a prefix index "
    "per model, and answers overlap queries (NATS request/reply) with each worker's cached prefix depth."
)


async def run(settings: KvIndexerSettings) -> None:
    log = configure_logging(settings.log_level, settings.log_format, "kv-indexer")
    await run_service(KvIndexerService(settings), name="kv-indexer", metrics_host=settings.metrics_host,
                      metrics_port=settings.metrics_port, log=log)


def main(argv: list[str] | None = None) -> None:
    settings, _ = parse_cli(KvIndexerSettings, argv, prog="infera-kv-indexer", description=DESCRIPTION)
    settings.require_supported()
    with event_loop_runner() as runner:
        runner.run(run(settings))


if __name__ == "__main__":
    main(sys.argv[1:])
