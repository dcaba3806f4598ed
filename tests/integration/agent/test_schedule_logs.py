"""A job that overruns for many periods logs one line when it starts and one when it
runs on time again, and APScheduler's own per-skip warning is not passed through
(issue 12 item 14); every skip is still counted."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from loguru import logger

from gpudaemon.logsetup import setup_logging
from gpudaemon.schedule import CronScheduler
from tests.support import wait_for

# Real APScheduler runs in real time (its clock cannot be injected): seconds per test.
pytestmark = pytest.mark.integration


@pytest.fixture
def log_lines() -> Iterator[list[str]]:
    setup_logging("DEBUG")  # routes apscheduler's stdlib logging into loguru
    lines: list[str] = []
    sink = logger.add(
        lambda m: lines.append(str(m).rstrip("\n")), level="DEBUG", format="{message}"
    )
    try:
        yield lines
    finally:
        logger.remove(sink)


def test_an_overrun_episode_is_two_lines_however_many_runs_it_skips(
    log_lines: list[str],
) -> None:
    release, runs, overruns = threading.Event(), [], []
    sched = CronScheduler(on_overrun=overruns.append)

    def stuck_then_quick() -> None:
        runs.append(1)
        if len(runs) == 1:
            release.wait(30)  # an API call stuck for several periods

    sched.add("kube-retry", stuck_then_quick, "* * * * * *")
    sched.start()
    try:
        wait_for(lambda: len(overruns) >= 3, timeout=30, what="three skipped runs")
        release.set()
        wait_for(lambda: len(runs) >= 3, timeout=30, what="the job running on time again")
    finally:
        release.set()
        sched.shutdown(wait=True)

    assert not [line for line in log_lines if "maximum number of running instances" in line]
    started = [line for line in log_lines if "overran its schedule" in line]
    ended = [line for line in log_lines if "runs on schedule again" in line]
    assert len(started) == 1 and len(ended) == 1, log_lines
    assert f"({len(overruns)} skipped)" in ended[0]
    assert sched.stats.by_job["kube-retry"]["overruns"] == len(overruns) >= 3


def test_a_second_episode_logs_again(log_lines: list[str]) -> None:
    gate, runs, overruns = threading.Event(), [], []
    sched = CronScheduler(on_overrun=overruns.append)

    def job() -> None:
        runs.append(1)
        if len(runs) in (1, 3):
            gate.wait(30)
            gate.clear()

    sched.add("labels", job, "* * * * * *")
    sched.start()
    try:
        wait_for(lambda: len(overruns) >= 2, timeout=30, what="first episode")
        gate.set()
        wait_for(lambda: len(runs) >= 3, timeout=30, what="the third run (stuck again)")
        first = len(overruns)
        wait_for(lambda: len(overruns) >= first + 2, timeout=30, what="second episode")
        gate.set()
        wait_for(lambda: len(runs) >= 4, timeout=30, what="recovery")
    finally:
        gate.set()
        sched.shutdown(wait=True)
    assert sum("overran its schedule" in line for line in log_lines) == 2, log_lines
    assert sum("runs on schedule again" in line for line in log_lines) >= 1
