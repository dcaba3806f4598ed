"""Logging through loguru; stdlib loggers (apscheduler, urllib3, kubernetes) are routed in."""

from __future__ import annotations

import logging
import sys

from loguru import logger


class _Intercept(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        try:
            level: str | int = logger.level(record.levelname).name
        except ValueError:
            level = record.levelno
        logger.opt(depth=6, exception=record.exc_info).log(level, record.getMessage())


def setup_logging(level: str = "INFO", json: bool = False) -> None:
    """Human-readable lines on stderr by default, one JSON object per line with json=True."""
    logger.remove()
    if json:
        logger.add(sys.stderr, level=level, serialize=True, backtrace=False, diagnose=False)
    else:
        logger.add(
            sys.stderr,
            level=level,
            format="<green>{time:YYYY-MM-DDTHH:mm:ss.SSSZ}</green> <level>{level: <7}</level> "
            "<cyan>{name}</cyan> {message}",
            backtrace=False,
            diagnose=False,
        )
    logging.basicConfig(handlers=[_Intercept()], level=0, force=True)
    # Chatty libraries: keep their warnings, drop their per-request debug lines.
    for name in ("apscheduler", "urllib3", "kubernetes", "influxdb_client"):
        logging.getLogger(name).setLevel(logging.WARNING)
