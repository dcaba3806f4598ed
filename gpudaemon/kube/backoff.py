"""Exponential backoff for API writes after failures."""

from __future__ import annotations

import random
from collections.abc import Callable


class Backoff:
    """Exponential backoff with "equal jitter": delay in [d/2, d], d = base*2^n <= cap.

    Half the delay is kept so retries after a long outage stay spread out but never
    come sooner than half the cap; the jitter keeps a fleet from retrying in lockstep.
    The cap is injected (config `kubernetes.backoff_max_seconds`), so tests shorten it.
    """

    def __init__(
        self, base_s: float, cap_s: float, rng: Callable[[], float] = random.random
    ) -> None:
        self.base, self.cap, self.rng = base_s, cap_s, rng
        self.failures = 0

    def next_delay(self) -> float:
        d = min(self.cap, self.base * float(2 ** min(self.failures, 30)))
        self.failures += 1
        return d / 2 + self.rng() * d / 2

    def reset(self) -> None:
        self.failures = 0
