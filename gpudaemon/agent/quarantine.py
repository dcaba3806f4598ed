"""The fast health path: a GPU that turns unhealthy is quarantined at once (the `gpus`
annotation, the health labels, the `GPUHealthy` condition, the optional taint and,
with DRA, its DeviceTaintRule), not at the next label reconcile (every 30 s).

Two things wake it:
- a critical XID (or XID 154, the driver's recovery action changed) from the
  backend's event set: it polls the GPUs at once, so the verdict is judged from the
  counters the event just raised (the same verdict table as every poll);
- a telemetry poll that finds a GPU unhealthy that the Node does not show yet (lost,
  uncorrected ECC, row remap, recovery action): caught at the poll interval.

Then, if a GPU is unhealthy that the last reconcile did not publish, it runs the label
reconcile out of turn. That reconcile writes only what changed, so one change of verdict
is one write per object (Node metadata, Node status, DeviceTaintRule), and a GPU that
turns better again waits for the regular reconcile and its hysteresis: quarantine fast,
release carefully. An XID storm costs no writes: an XID already seen on a GPU cannot
change its verdict (the verdict reads which XIDs occurred, not how often), and fast
polls are spaced by `min_poll_interval_s`."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from loguru import logger

from gpudaemon.agent.wakeloop import WakeLoop
from gpudaemon.backends.base import is_critical_xid

RECOVERY_ACTION_XID = 154  # the driver's recovery action changed: the next poll reads it
MIN_POLL_INTERVAL_S = 0.2
_MAX_SEEN = 4096  # (GPU, XID) pairs remembered for the storm filter


class Quarantine:
    """Runs on its own thread (`start`); `on_xid` and `after_poll` only set a flag."""

    def __init__(
        self,
        poll: Callable[[], object],
        reconcile: Callable[[], object],
        unhealthy: Callable[[], frozenset[str]],
        observe: Callable[[str, float], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        min_poll_interval_s: float = MIN_POLL_INTERVAL_S,
    ) -> None:
        self._poll = poll
        self._reconcile = reconcile
        self._unhealthy = unhealthy
        self._observe = observe or (lambda trigger, seconds: None)
        self.clock = clock
        self.min_poll_interval_s = min_poll_interval_s
        self._lock = threading.Lock()
        self._loop = WakeLoop("quarantine", self.step)
        self._stop = self._loop.stopping
        self._published: frozenset[str] | None = None  # None: no reconcile yet
        self._seen: set[tuple[int, int]] = set()
        self._poll_due: float | None = None  # when the XID that asked for a poll came
        self._noticed: float | None = None  # when a poll found a GPU to quarantine
        self._last_poll = -float("inf")

    # -- what wakes it (other threads) ------------------------------------------------

    def on_xid(self, index: int, xid: int) -> None:
        """From the backend's XID event thread."""
        if xid != RECOVERY_ACTION_XID and not is_critical_xid(xid):
            return  # an application XID: counted, the GPU stays healthy
        with self._lock:
            if xid != RECOVERY_ACTION_XID:
                if (index, xid) in self._seen:
                    return  # the verdict already reads this XID: a storm, no news
                if len(self._seen) >= _MAX_SEEN:
                    self._seen.clear()
                self._seen.add((index, xid))
            if self._poll_due is None:
                self._poll_due = self.clock()
        self._loop.wake()

    def after_poll(self) -> None:
        """At the end of every telemetry poll: a GPU unhealthy that the Node does not
        show yet is quarantined now."""
        if self._news():
            with self._lock:
                if self._noticed is None:
                    self._noticed = self.clock()
            self._loop.wake()

    def published(self, unhealthy: frozenset[str]) -> None:
        """From the label reconcile: the unhealthy GPUs (UUIDs) it wrote."""
        with self._lock:
            if self._published is not None and not unhealthy >= self._published:
                self._seen.clear()  # a GPU released (a reset): its XIDs count again
            self._published = unhealthy

    def _news(self) -> frozenset[str]:
        with self._lock:
            published = self._published
        if published is None:
            return frozenset()  # the first reconcile publishes everything anyway
        return self._unhealthy() - published

    # -- the thread -------------------------------------------------------------------

    def start(self) -> None:
        self._loop.start()

    def stop(self) -> None:
        self._loop.stop(timeout_s=5)

    def step(self) -> bool:
        """One wake-up: the poll an XID asked for, then the reconcile if a GPU needs
        quarantine. True if it reconciled."""
        with self._lock:
            xid_at, self._poll_due = self._poll_due, None
        if xid_at is not None:
            spacing = self._last_poll + self.min_poll_interval_s - self.clock()
            if spacing > 0 and self._stop.wait(spacing):
                return False
            self._last_poll = self.clock()
            self._poll()
        news = self._news()
        with self._lock:
            polled_at, self._noticed = self._noticed, None
        if not news:
            return False
        since = xid_at if xid_at is not None else polled_at
        trigger = "xid" if xid_at is not None else "poll"
        self._reconcile()
        took = self.clock() - (since if since is not None else self.clock())
        self._observe(trigger, took)
        logger.info(
            "quarantined {} GPU(s) {}: labels written {:.0f} ms after the {}",
            len(news),
            ", ".join(sorted(news)),
            took * 1000,
            "XID event" if trigger == "xid" else "poll that found it",
        )
        return True
