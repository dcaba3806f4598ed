"""A daemon thread that runs one step each time it is woken, until stopped: the
agent's out-of-turn paths (quarantine.py, reset.py) are woken from other threads (the
XID event loop, a poll, the Node watch) and must never block them."""

from __future__ import annotations

import threading
from collections.abc import Callable

from loguru import logger


class WakeLoop:
    def __init__(self, name: str, step: Callable[[], object]) -> None:
        self.name, self.step = name, step
        self._wake = threading.Event()
        self.stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def wake(self) -> None:
        self._wake.set()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float) -> None:
        """Ends the loop; a step under way finishes first (up to `timeout_s`)."""
        self.stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        while True:
            self._wake.wait()
            if self.stopping.is_set():
                return
            self._wake.clear()
            try:
                self.step()
            except Exception as e:  # a bug must not end the path for good
                logger.opt(exception=e).error("{} step failed: {}", self.name, e)
