"""The maintenance window: "HH:MM-HH:MM" in UTC, every day; it may wrap past midnight
("22:00-06:00"). Empty: any time."""

from __future__ import annotations

import time


def _minutes(hhmm: str) -> int:
    return int(hhmm[:2]) * 60 + int(hhmm[3:5])


def open_at(window: str, unix_s: float) -> bool:
    """Whether a reset may start at `unix_s`."""
    if not window:
        return True
    start, end = _minutes(window[:5]), _minutes(window[6:])
    t = time.gmtime(unix_s)
    now = t.tm_hour * 60 + t.tm_min
    if start < end:
        return start <= now < end
    return now >= start or now < end
