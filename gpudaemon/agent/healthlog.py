"""GPU faults in the log: one line when a problem starts and one when it ends, for every
backend alike (NVML and simulated), read from the samples the agent already takes.

- A GPU turning unhealthy (lost, a critical XID, uncorrected ECC) is one ERROR line
  with the reason; it turning healthy again is one INFO line.
- On a GPU that stays healthy, a rising XID counter (an application XID) is one ERROR
  line, and a rising corrected-ECC counter one WARNING line, when the burst starts;
  when the counter has not risen for `quiet_s` seconds, one INFO line ends the burst.
  While a GPU is unhealthy its counters add no lines: the health line already says it,
  and every event is counted in the metrics.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from loguru import logger

from gpudaemon.model import GpuSample


@dataclass
class _Burst:
    started_total: int  # the counter's value before the burst
    last_total: int
    last_rise: float


class HealthLog:
    """Feed it every telemetry sample (`observe`); it logs transitions only."""

    def __init__(self, quiet_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.quiet_s = quiet_s
        self.clock = clock
        self._lock = threading.Lock()
        self._unhealthy: dict[int, str] = {}  # index -> reason being reported
        self._counts: dict[tuple[int, str], int] = {}  # (index, counter) -> last value
        self._bursts: dict[tuple[int, str], _Burst] = {}

    def observe(self, samples: Iterable[GpuSample]) -> None:
        now = self.clock()
        with self._lock:
            for s in samples:
                self._health(s)
                for name, total in _counters(s):
                    self._counter(s, name, total, now)
            self._end_quiet_bursts(now)

    def _health(self, s: GpuSample) -> None:
        was = self._unhealthy.get(s.index)
        if not s.healthy:
            reason = s.health_reason or "unhealthy"
            if was is None:
                logger.error("GPU {} ({}) unhealthy: {}", s.index, s.uuid, reason)
                # Bursts on it end silently: the health line covers the GPU now.
                for key in [k for k in self._bursts if k[0] == s.index]:
                    del self._bursts[key]
            self._unhealthy[s.index] = reason
        elif was is not None:
            del self._unhealthy[s.index]
            logger.info("GPU {} ({}) healthy again (was: {})", s.index, s.uuid, was)

    def _counter(self, s: GpuSample, name: str, total: int, now: float) -> None:
        key = (s.index, name)
        before = self._counts.get(key)
        self._counts[key] = total
        rose = total > (before or 0)
        if not rose or s.index in self._unhealthy:
            return
        burst = self._bursts.get(key)
        if burst is not None:
            burst.last_total, burst.last_rise = total, now
            return
        self._bursts[key] = _Burst(before or 0, total, now)
        new = total - (before or 0)
        if name == "ecc corrected":
            logger.warning("GPU {} ({}): {} corrected ECC error(s)", s.index, s.uuid, new)
        else:
            logger.error(
                "GPU {} ({}): {} ({} new; application error: counted, GPU stays healthy)",
                s.index,
                s.uuid,
                name.upper(),
                new,
            )

    def _end_quiet_bursts(self, now: float) -> None:
        for (index, name), b in list(self._bursts.items()):
            if now - b.last_rise >= self.quiet_s:
                del self._bursts[(index, name)]
                what = "corrected ECC errors" if name == "ecc corrected" else name.upper()
                logger.info(
                    "GPU {}: no new {} for {:.0f}s ({} in that burst)",
                    index,
                    what,
                    self.quiet_s,
                    b.last_total - b.started_total,
                )


def _counters(s: GpuSample) -> list[tuple[str, int]]:
    """The fault counters of a sample, by name ("xid 13", "ecc corrected")."""
    out = [(f"xid {xid}", n) for xid, n in sorted(s.xid_errors_total.items())]
    if s.ecc_corrected_errors_total is not None:
        out.append(("ecc corrected", s.ecc_corrected_errors_total))
    return out
