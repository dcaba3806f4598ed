"""The one fake clock for tests: call it for the time, move it by hand."""

from __future__ import annotations

T0 = 1_700_000_000.0  # 2023-11-14T22:13:20Z: a plausible wall-clock time


class FakeClock:
    """A stand-in for time.time / time.monotonic that only moves when told to.

    `sleep` advances it instead of waiting, so code that sleeps between retries runs
    instantly under test.
    """

    def __init__(self, t: float = T0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    @property
    def now(self) -> float:
        return self.t

    @now.setter
    def now(self, value: float) -> None:
        self.t = value

    def advance(self, seconds: float) -> float:
        self.t += seconds
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += max(0.0, seconds)
