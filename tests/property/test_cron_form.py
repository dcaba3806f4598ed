"""The cron form the chart's values schema enforces (schedule.CRON_PATTERN and
backward_range, which the agent checks too) is a subset of what APScheduler accepts,
searched by hypothesis over 300 expressions (seconds long; the unit suite stays quick)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gpudaemon.errors import CronError
from gpudaemon.schedule import check_cron_form, parse_cron

_VALUES = ["*", "0", "5", "7", "12", "23", "31", "59", "60", "mon", "fri", "sun", "jan", "dec"]


@st.composite
def _cron_field(draw: st.DrawFn) -> str:
    items = []
    for _ in range(draw(st.integers(1, 3))):
        a = draw(st.sampled_from(_VALUES))
        item = a
        if a != "*" and draw(st.booleans()):
            item += "-" + draw(st.sampled_from(_VALUES[1:]))
        if draw(st.booleans()):
            item += "/" + draw(st.sampled_from(["1", "2", "15", "0"]))
        items.append(item)
    return ",".join(items)


@settings(max_examples=300, deadline=None)
@given(st.lists(_cron_field(), min_size=5, max_size=6))
def test_every_expression_of_the_checked_form_is_one_apscheduler_runs(fields: list[str]) -> None:
    """The form the chart's schema enforces (CRON_PATTERN, backward_range) is a subset of
    what APScheduler accepts: an expression `helm install` lets through never makes the
    agent crash-loop."""
    expr = " ".join(fields)
    try:
        check_cron_form(expr)
    except CronError:
        return
    parse_cron(expr)  # must not raise
