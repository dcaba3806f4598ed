"""Cron schedules on APScheduler 3.x: parsing, job defaults, overrun accounting.

Every job runs with max_instances=1 and coalescing, so a slow poll is skipped (and
counted) rather than stacked, and a backlog after a pause runs once, not N times.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import tzinfo
from typing import Any, Protocol

from apscheduler.events import (
    EVENT_JOB_ERROR,
    EVENT_JOB_EXECUTED,
    EVENT_JOB_MAX_INSTANCES,
    EVENT_JOB_MISSED,
    EVENT_JOB_SUBMITTED,
    JobExecutionEvent,
    JobSubmissionEvent,
)
from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.cron import CronTrigger
from loguru import logger

from gpudaemon.errors import CronError, GpudaemonError
from gpudaemon.logsetup import LogLimiter

_DOW_NAMES = {0: "sun", 1: "mon", 2: "tue", 3: "wed", 4: "thu", 5: "fri", 6: "sat", 7: "sun"}


def _dow(field_: str) -> str:
    """Crontab counts Sunday as 0 (and 7); APScheduler 3 counts Monday as 0. Use names,
    and split a range that starts on Sunday ("0-3" -> "sun,mon-wed"), since Sunday is
    the last day of APScheduler's week."""
    if field_ in ("0-6", "0-7", "1-7", "sun-sat"):
        return "*"
    named = re.sub(r"(?<![/\d])\d+", lambda m: _DOW_NAMES.get(int(m.group()), m.group()), field_)
    parts = []
    for part in named.split(","):
        if part.startswith("sun-") and "/" not in part:
            end = part.removeprefix("sun-")
            parts.append("sun" if end == "sun" else f"sun,mon-{end}" if end != "mon" else "sun,mon")
        else:
            parts.append(part)
    return ",".join(parts)


# The cron form every schedule must have, checked before APScheduler sees it, and given
# as-is to the Helm chart's values schema (Go's RE2 and Python's re read it the same),
# so `helm install` refuses what the agent would refuse: five crontab fields, or six
# with seconds first; each field `*` or `*/step` (at most the field's span), values in
# range, ranges a-b, numeric ranges with a step a-b/n (not weekdays), lists; month and
# weekday names in lower case. What a pattern cannot say, a range that runs backwards
# or a step wider than its range, is `backward_range` and `bad_step` (the chart's
# template makes the same checks). tests/property/test_cron_form.py holds the form to
# what APScheduler runs.
def _field(value: str, step: str, number: str | None = None) -> str:
    """`number`: the numeric values, which may form a stepped range `a-b/n` (APScheduler
    takes no step after a range of names, and none on weekdays here)."""
    ranged = rf"|{number}-{number}/{step}" if number else ""
    item = rf"(?:\*(?:/{step})?{ranged}|{value}(?:-{value})?)"
    return rf"{item}(?:,{item})*"


# A step after `*`, or after a numeric range, and at most the field's span (APScheduler
# refuses a larger one; for a range, at most its width: `bad_step`).
_STEP_59 = r"(?:[1-9]|[1-5][0-9])"
_SEC = _field(r"[0-5]?[0-9]", _STEP_59, r"[0-5]?[0-9]")
_HOUR = _field(r"(?:[01]?[0-9]|2[0-3])", r"(?:[1-9]|1[0-9]|2[0-3])", r"(?:[01]?[0-9]|2[0-3])")
_DOM = _field(
    r"(?:0?[1-9]|[12][0-9]|3[01])", r"(?:[1-9]|[12][0-9]|30)", r"(?:0?[1-9]|[12][0-9]|3[01])"
)
_MONTH = _field(
    r"(?:0?[1-9]|1[0-2]|jan|feb|mar|apr|may|jun|jul|aug|sep|oct|nov|dec)",
    r"(?:[1-9]|1[01])",
    r"(?:0?[1-9]|1[0-2])",
)
_DOW = _field(r"(?:[0-7]|sun|mon|tue|wed|thu|fri|sat)", r"[1-6]")
CRON_PATTERN = rf"^\s*(?:{_SEC}\s+)?{_SEC}\s+{_HOUR}\s+{_DOM}\s+{_MONTH}\s+{_DOW}\s*$"
_CRON_RE = re.compile(CRON_PATTERN)
_NAMES = {
    n: i
    for names in (
        ("sun", "mon", "tue", "wed", "thu", "fri", "sat"),
        ("", "jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"),
    )
    for i, n in enumerate(names)
    if n
}


def backward_range(expr: str) -> str | None:
    """The first range that runs backwards (`5-3`, `fri-mon`), else None."""
    for a, b in re.findall(r"([0-9a-z]+)-([0-9a-z]+)", expr):
        lo, hi = (int(x) if x.isdigit() else _NAMES.get(x, -1) for x in (a, b))
        if lo > hi:
            return f"{a}-{b}"
    return None


def bad_step(expr: str) -> str | None:
    """The first stepped range whose step is wider than the range (`0-10/20`), else
    None: APScheduler refuses it, and a pattern cannot say it."""
    for a, b, n in re.findall(r"([0-9]+)-([0-9]+)/([0-9]+)", expr):
        if int(a) <= int(b) < int(a) + int(n):
            return f"{a}-{b}/{n}"
    return None


def check_cron_form(expr: str) -> None:
    """CronError, one line, when `expr` is not of the cron form the docs describe."""
    n = len(expr.split())
    if n not in (5, 6):
        raise CronError(
            f"invalid cron expression {expr!r}: expected 5 fields "
            f"(min hour day month weekday) or 6 (sec min hour day month weekday), got {n}"
        )
    if not _CRON_RE.fullmatch(expr):
        raise CronError(
            f"invalid cron expression {expr!r}: a field is out of range or malformed "
            "(sec 0-59, min 0-59, hour 0-23, day 1-31, month 1-12 or jan-dec, weekday 0-7 "
            "or sun-sat, names in lower case; each `*` or `*/step`, a value, a range a-b or "
            "a-b/step of numbers (not weekdays), or a list a,b)"
        )
    backwards = backward_range(expr)
    if backwards:
        raise CronError(f"invalid cron expression {expr!r}: the range {backwards} runs backwards")
    wide = bad_step(expr)
    if wide:
        raise CronError(
            f"invalid cron expression {expr!r}: in {wide} the step is larger than the range"
        )


def parse_cron(expr: str, timezone: tzinfo | str = "UTC") -> CronTrigger:
    """Five fields (minute-resolution crontab) or six with seconds first."""
    check_cron_form(expr)
    fields = expr.split()
    if len(fields) == 5:
        second, (minute, hour, day, month, dow) = "0", fields
    elif len(fields) == 6:
        second, minute, hour, day, month, dow = fields
    else:
        raise CronError(
            f"invalid cron expression {expr!r}: expected 5 fields "
            f"(min hour day month weekday) or 6 (sec min hour day month weekday), got {len(fields)}"
        )
    try:
        return CronTrigger(
            second=second,
            minute=minute,
            hour=hour,
            day=day,
            month=month,
            day_of_week=_dow(dow),
            timezone=timezone,
        )
    except ValueError as e:
        raise CronError(f"invalid cron expression {expr!r}: {e}") from None


@dataclass(frozen=True)
class Job:
    """One row of the agent's job table: a name (the `task` metric label), a cron
    expression and the function. The function raises a GpudaemonError to fail; the
    agent's one wrapper counts and times every run, whatever the job."""

    name: str
    cron: str
    run: Callable[[], object]


class JobRunner:
    """The one wrapper every run of every job goes through: times it, and on failure
    keeps the last good data, counts it and logs it (the first failure of a run of
    them, then at most once a minute, and once when the job works again)."""

    def __init__(self, jobs: dict[str, Job], metrics: JobMetrics) -> None:
        self.jobs = jobs
        self.metrics = metrics
        self._log = LogLimiter(60.0)
        # One run of a job at a time, whoever runs it: the scheduler, or the quarantine
        # path running the telemetry poll or the label reconcile out of turn.
        self._running = {name: threading.Lock() for name in jobs}
        # Each job's series exist from the start, at 0; the children are kept (a label
        # lookup per run cost more than the rest of the wrapper).
        self._timed = {
            name: (
                metrics.poll_duration_seconds.labels(name),
                metrics.poll_cpu_seconds.labels(name),
            )
            for name in jobs
        }
        for name in jobs:
            metrics.poll_errors.labels(name)
            metrics.job_overruns.labels(name)

    def run(self, name: str) -> bool:
        """True when the job succeeded; a job not configured is a success."""
        job = self.jobs.get(name)
        if job is None:
            return True
        with self._running.setdefault(name, threading.Lock()):
            return self._run(name, job)

    def _run(self, name: str, job: Job) -> bool:
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            job.run()
        except GpudaemonError as e:
            self.metrics.poll_errors.labels(name).inc()
            if not e.reported and self._log.allow(name):
                logger.error("{} failed: {}", name, e)
            return False
        except Exception as e:  # a bug must not kill the scheduler thread
            self.metrics.poll_errors.labels(name).inc()
            if self._log.allow(name):
                logger.opt(exception=e).error("{} failed unexpectedly: {}", name, e)
            return False
        finally:
            wall, cpu_total = self._timed.get(name) or (
                self.metrics.poll_duration_seconds.labels(name),
                self.metrics.poll_cpu_seconds.labels(name),
            )
            wall.observe(time.perf_counter() - start)
            # CPU beside wall time: a slow poll that waits (a driver call, a lock) and one
            # that computes look alike in the duration alone.
            cpu_total.inc(time.thread_time() - cpu)
        if self._log.forget(name):
            logger.info("{} works again", name)
        return True


class JobMetrics(Protocol):
    """What the runner counts: per-job errors, overruns and durations (labelled by
    job name, as AgentMetrics has them)."""

    poll_errors: Any
    job_overruns: Any
    poll_duration_seconds: Any
    poll_cpu_seconds: Any


@dataclass
class JobStats:
    """Per-job counts of overruns, misses and errors (for logs and tests; the agent's
    metrics count overruns through the on_overrun callback)."""

    by_job: dict[str, dict[str, int]] = field(default_factory=dict)

    def bump(self, job: str, what: str) -> None:
        d = self.by_job.setdefault(job, {"overruns": 0, "misses": 0, "errors": 0})
        d[what] += 1


class _DropSkipWarnings(logging.Filter):
    """APScheduler warns on every skipped or missed run (every second during an
    outage, for a per-second job). Our listener counts each one and logs one line per
    episode instead, so APScheduler's own copies are dropped."""

    PREFIXES = (
        'Execution of job "%s" skipped: maximum number of running instances',
        'Run time of job "%s" was missed by',
    )

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.msg if isinstance(record.msg, str) else ""
        return not msg.startswith(self.PREFIXES)


_DROP_SKIPS = _DropSkipWarnings()


def _silence_apscheduler_skips(executor: str = "default") -> None:
    for name in ("apscheduler.scheduler", f"apscheduler.executors.{executor}"):
        lg = logging.getLogger(name)
        if _DROP_SKIPS not in lg.filters:
            lg.addFilter(_DROP_SKIPS)


class CronScheduler:
    """A BackgroundScheduler with our defaults and listeners.

    A skipped run (the previous one still going) or a missed one is counted every
    time (`stats`, `on_overrun`), and logged once per episode: one WARNING when a job
    starts overrunning, one INFO when it runs on schedule again.
    """

    def __init__(
        self,
        misfire_grace_seconds: int = 5,
        workers: int = 4,
        on_overrun: Callable[[str], None] | None = None,
        on_error: Callable[[str], None] | None = None,
    ) -> None:
        self.stats = JobStats()
        self._on_overrun = on_overrun
        self._on_error = on_error
        self._sched = BackgroundScheduler(
            executors={"default": ThreadPoolExecutor(workers)},
            job_defaults={
                "max_instances": 1,
                "coalesce": True,
                "misfire_grace_time": misfire_grace_seconds,
            },
            timezone="UTC",
        )
        self._sched.add_listener(
            self._listen,
            EVENT_JOB_MAX_INSTANCES
            | EVENT_JOB_MISSED
            | EVENT_JOB_ERROR
            | EVENT_JOB_SUBMITTED
            | EVENT_JOB_EXECUTED,
        )
        _silence_apscheduler_skips()
        self._lock = threading.Lock()
        # Once per episode, keyed by (job, "overruns"|"misses"); the count of the episode.
        self._episode_log = LogLimiter()
        self._episode: dict[tuple[str, str], int] = {}

    def add(self, name: str, func: Callable[[], Any], cron: str) -> None:
        self._sched.add_job(func, parse_cron(cron), id=name, name=name, replace_existing=True)

    def start(self) -> None:
        self._sched.start()

    def shutdown(self, wait: bool = True) -> None:
        """Stop firing new runs; with wait=True let the running ones finish."""
        if self._sched.running:
            self._sched.shutdown(wait=wait)

    def _listen(self, event: JobSubmissionEvent | JobExecutionEvent) -> None:
        job = event.job_id
        with self._lock:
            if event.code == EVENT_JOB_MAX_INSTANCES:
                self.stats.bump(job, "overruns")
                self._start_episode(
                    job,
                    "overruns",
                    "job {} overran its schedule: previous run still going, "
                    "skipped (counted in gpudaemon_job_overruns_total; logged once until it "
                    "runs on time again)",
                )
                if self._on_overrun:
                    self._on_overrun(job)
            elif event.code == EVENT_JOB_SUBMITTED:
                self._end_episode(job, "overruns", "job {} runs on schedule again ({} skipped)")
            elif event.code == EVENT_JOB_MISSED:
                self.stats.bump(job, "misses")
                self._start_episode(
                    job, "misses", "job {} missed its run time (process was busy or paused)"
                )
            elif event.code == EVENT_JOB_EXECUTED:
                self._end_episode(job, "misses", "job {} runs on time again ({} missed)")
            elif event.code == EVENT_JOB_ERROR:
                self.stats.bump(job, "errors")
                exc = getattr(event, "exception", None)
                logger.error("job {} failed: {}", job, exc)
                if self._on_error:
                    self._on_error(job)

    def _start_episode(self, job: str, what: str, message: str) -> None:
        key = (job, what)
        self._episode[key] = self._episode.get(key, 0) + 1
        if self._episode_log.allow(key):
            logger.warning(message, job)

    def _end_episode(self, job: str, what: str, message: str) -> None:
        key = (job, what)
        n = self._episode.pop(key, 0)
        if self._episode_log.forget(key):
            logger.info(message, job, n)
