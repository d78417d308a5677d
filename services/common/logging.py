"""structlog JSON logging with the service name bound on every line."""

from __future__ import annotations

import logging
import sys

import structlog

from services.common.errors import FieldError


class _Stderr:
    """Whatever sys.stderr is when a line is written: a logger configured while stderr was swapped (a test's capture,
    closed afterwards) must not fail every later log call, least of all one inside an error handler."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(service: str, level: str = "info") -> structlog.stdlib.BoundLogger:
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise FieldError("log_level", f"unknown level {level!r}")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=_Stderr()),  # type: ignore[arg-type]
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.bind_contextvars(service=service)
    return structlog.get_logger()


def get_logger() -> structlog.stdlib.BoundLogger:
    return structlog.get_logger()
