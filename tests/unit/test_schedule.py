"""Cron parsing (5 and 6 fields, fixed clock) and the scheduler's overrun handling."""

from datetime import UTC, datetime, timedelta

import pytest

from gpudaemon.errors import CronError
from gpudaemon.schedule import parse_cron

T0 = datetime(2026, 11, 22, 10, 0, 0, 300000, tzinfo=UTC)  # a Sunday


def fires(expr: str, n: int, now: datetime = T0) -> list[datetime]:
    trig, out, prev = parse_cron(expr), [], None
    for _ in range(n):
        nxt = trig.get_next_fire_time(prev, now)
        out.append(nxt)
        prev, now = nxt, nxt + timedelta(microseconds=1)
    return out


def test_six_fields_have_seconds() -> None:
    got = fires("*/5 * * * * *", 3)
    assert [t.second for t in got] == [5, 10, 15] and got[0].minute == 0


def test_five_fields_are_minute_resolution() -> None:
    got = fires("*/15 * * * *", 2)
    assert [(t.minute, t.second) for t in got] == [(15, 0), (30, 0)]


def test_inventory_default_every_five_minutes() -> None:
    assert [t.minute for t in fires("0 */5 * * * *", 2)] == [5, 10]


def test_weekday_numbers_follow_crontab_sunday_is_zero() -> None:
    # T0 is a Sunday: "0" must fire today, "1" (Monday) tomorrow.
    assert fires("0 12 * * 0", 1)[0].date() == T0.date()
    assert fires("0 12 * * 1", 1)[0].weekday() == 0
    assert fires("0 12 * * 1-5", 1)[0].weekday() == 0
    assert fires("0 12 * * 0-6", 1)[0].date() == T0.date()
    # ranges that start on Sunday (the end of APScheduler's week) still work
    assert [t.weekday() for t in fires("0 12 * * 0-3", 4)] == [6, 0, 1, 2]
    assert [t.weekday() for t in fires("0 12 * * sun-tue", 3)] == [6, 0, 1]


def test_stepped_ranges_fire_as_crontab_does() -> None:
    assert [t.minute for t in fires("10-30/10 * * * *", 4)] == [10, 20, 30, 10]
    assert [t.hour for t in fires("0 8-18/5 * * *", 3)] == [13, 18, 8]


@pytest.mark.parametrize(
    "expr",
    [
        "0-10/20 * * * *",
        "5-5/1 * * * *",
        "0 0 * * 1-5/2",
        "",
        "* * * *",
        "* * * * * * *",
        "61 * * * *",
        "*/0 * * * * *",
        "a b c d e",
        "* * 32 * *",
    ],
)
def test_invalid_expressions_raise_one_line(expr: str) -> None:
    with pytest.raises(CronError) as e:
        parse_cron(expr)
    assert "invalid cron expression" in str(e.value) and "\n" not in str(e.value)
