"""``infera-kv-indexer`` / ``python -m infera_kv_indexer``: settings, logging, metrics endpoint, signals."""

from __future__ import annotations

import sys

from infera_common.runtime import service_main

from infera_kv_indexer.service import KvIndexerService
from infera_kv_indexer.settings import KvIndexerSettings

DESCRIPTION = (
    "Infera kv-indexer: follows the engines' KV events into a prefix index per model (replayed from JetStream "
    "with --kv-event-transport nats; read from each engine's ZMQ publishers, with replay, with zmq), and "
    "answers overlap queries (NATS request/reply) with each worker's cached prefix depth."
)


def main(argv: list[str] | None = None) -> None:
    service_main(argv, KvIndexerSettings, KvIndexerService, name="kv-indexer", prog="infera-kv-indexer", description=DESCRIPTION)


if __name__ == "__main__":
    main(sys.argv[1:])
