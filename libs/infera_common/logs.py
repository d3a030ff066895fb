"""Structured logging (structlog) for every service: JSON lines by default."""

from __future__ import annotations

import logging
import sys

import structlog


#: fields every line of this process carries (its service; a worker-agent's worker id)
_PROCESS: dict[str, object] = {}


def _process_fields(_logger, _method: str, event: dict) -> dict:
    for key, value in _PROCESS.items():
        event.setdefault(key, value)
    return event


def configure_logging(level: str = "info", fmt: str = "json", service: str = "",
                      **fields: object) -> structlog.stdlib.BoundLogger:
    """Configure structlog + stdlib logging once per process and return the service's logger. Every
    line then carries ``service`` and ``fields`` (a worker-agent: its ``worker_id``), whichever
    module logs it: aggregated logs can be filtered by them."""
    _PROCESS.clear()
    _PROCESS.update({"service": service} if service else {}, **fields)
    lvl = getattr(logging, level.upper(), logging.INFO)
    logging.basicConfig(stream=sys.stderr, level=lvl, format="%(message)s", force=True)
    renderer = structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            _process_fields,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    return structlog.get_logger(service) if service else structlog.get_logger()


def get_logger(name: str = "") -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(name)
