"""LogLimiter: the one rate limiter for repeated log lines."""

from __future__ import annotations

from gpudaemon.logsetup import LogLimiter
from tests.clock import FakeClock


def test_first_line_per_key_then_once_per_interval() -> None:
    clock = FakeClock()
    lim = LogLimiter(60.0, clock=clock)
    assert lim.allow("a") and lim.allow("b")
    assert not lim.allow("a")
    clock.advance(59.9)
    assert not lim.allow("a")
    clock.advance(0.1)
    assert lim.allow("a") and not lim.allow("a")


def test_infinite_interval_is_once_per_key_until_forgotten() -> None:
    lim = LogLimiter(clock=FakeClock())
    assert lim.allow(("memory", 0))
    assert not lim.allow(("memory", 0))
    assert lim.allow(("memory", 1))
    lim.forget(("memory", 0))
    assert lim.allow(("memory", 0))


def test_clear_reports_whether_an_outage_was_logged() -> None:
    lim = LogLimiter(clock=FakeClock())
    assert not lim.active and not lim.clear()  # nothing failed: no "works again" line
    assert lim.allow()
    assert not lim.allow()  # one line per outage
    assert lim.active
    assert lim.clear()  # recovery: log it once
    assert not lim.clear()
    assert lim.allow()  # the next outage logs again
