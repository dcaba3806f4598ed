"""Logging through loguru; stdlib loggers (apscheduler, urllib3, kubernetes) are routed in.
`LogLimiter` is the one way to keep a repeating failure from flooding the log."""

from __future__ import annotations

import logging
import math
import sys
import threading
import time
from collections.abc import Callable, Hashable

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


class LogLimiter:
    """Says whether a repeated log line should be written: the first time for a key,
    then at most once per `every_s` (infinite: once per key, ever).

    One instance per kind of message. For "once per outage" use `allow()` on each
    failure and `clear()` on success: `clear()` returns True when something had been
    logged, which is when a "works again" line is worth writing. Thread-safe.
    """

    def __init__(
        self, every_s: float = math.inf, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.every_s = every_s
        self.clock = clock
        self._last: dict[Hashable, float] = {}
        self._lock = threading.Lock()

    def allow(self, key: Hashable = None) -> bool:
        now = self.clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.every_s:
                return False
            self._last[key] = now
            return True

    def forget(self, key: Hashable = None) -> bool:
        """The next `allow(key)` is True again. True if the key had been allowed (for
        one key's "works again" line)."""
        with self._lock:
            return self._last.pop(key, None) is not None

    def clear(self) -> bool:
        """Forget every key; True if any line had been allowed since the last clear."""
        with self._lock:
            had = bool(self._last)
            self._last.clear()
            return had

    @property
    def active(self) -> bool:
        """True while some key has been allowed and not cleared (e.g. during an outage)."""
        with self._lock:
            return bool(self._last)
