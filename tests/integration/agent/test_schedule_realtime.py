"""The cron scheduler's overrun and shutdown rules on real APScheduler, in real time (its
clock cannot be injected): a job still running when it is due again is skipped and
counted, never stacked; shutdown waits for the running job and starts no other."""

from __future__ import annotations

import threading

import pytest

from gpudaemon.schedule import CronScheduler
from tests.support import wait_for

pytestmark = pytest.mark.integration


def test_overrunning_job_is_skipped_and_counted_not_stacked() -> None:
    release, running, overruns = threading.Event(), [], []
    sched = CronScheduler(on_overrun=overruns.append)

    def slow() -> None:
        running.append(1)
        release.wait(10)

    sched.add("telemetry", slow, "* * * * * *")
    sched.start()
    try:
        wait_for(lambda: overruns, 30, interval=0.05, what="an overrun of the stuck job")
    finally:
        release.set()
        sched.shutdown(wait=True)
    assert overruns and overruns[0] == "telemetry"
    assert len(running) == 1  # never two at once
    assert sched.stats.by_job["telemetry"]["overruns"] >= 1


def test_shutdown_waits_for_the_running_job_and_starts_no_other() -> None:
    started, release, runs = threading.Event(), threading.Event(), []

    def job() -> None:
        runs.append(1)
        started.set()
        release.wait(10)
        runs.append(2)

    sched = CronScheduler()
    sched.add("labels", job, "* * * * * *")
    sched.start()
    assert started.wait(10)
    threading.Timer(0.2, release.set).start()  # the job ends while shutdown waits
    sched.shutdown(wait=True)
    assert runs == [1, 2]  # the running job finished; no new run was started
