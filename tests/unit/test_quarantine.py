"""The fast health path (agent/quarantine.py): an XID from the backend's event set, or
a poll that finds a GPU unhealthy, reaches the label sink at once, not at the next
label reconcile; an XID storm and a GPU turning better add no out-of-turn writes.

The simulated XIDs go through the same event loop as NVML's (backends/xidevents.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from gpudaemon.agent.app import Agent
from gpudaemon.agent.quarantine import Quarantine
from gpudaemon.backends.simulated import FaultSpec, SimulatedBackend, load_profile
from gpudaemon.backends.simulated.events import SimEventSet
from gpudaemon.backends.xidevents import xid_event_loop
from gpudaemon.config import load_config
from gpudaemon.labels import LabelSet
from gpudaemon.labels.annotations import decode_gpus
from gpudaemon.labels.outputs import LocalOutput
from tests.support import wait_for

UNHEALTHY = "gpudaemon.io/gpu.unhealthy"


class TimedSink(LocalOutput):
    """Records each LabelSet with the time it arrived."""

    name = "timed"

    def __init__(self) -> None:
        self.applied: list[tuple[float, LabelSet]] = []

    def apply(self, ls: LabelSet) -> bool:
        self.applied.append((time.monotonic(), ls))
        return True

    def unhealthy(self) -> str | None:
        return self.applied[-1][1].labels.get(UNHEALTHY) if self.applied else None


@pytest.fixture
def running() -> Iterator[tuple[Agent, SimulatedBackend, TimedSink]]:
    """A live agent whose label reconcile runs only at minute 59 (never in a test), a
    telemetry poll every second, and no HTTP server."""
    cfg = load_config(
        environ={},
        overrides={
            "simulate": "dgx-h100",
            "node_name": "n1",
            "schedules": {"labels": "0 59 * * * *", "telemetry": "* * * * * *"},
        },
    )
    backend = SimulatedBackend(load_profile("dgx-h100"))
    sink = TimedSink()
    agent = Agent(cfg, backend=backend, registry=CollectorRegistry(), label_sink=sink)
    agent.start_http = lambda: 0  # type: ignore[method-assign]
    t = threading.Thread(target=agent.run, daemon=True)
    t.start()
    wait_for(lambda: sink.unhealthy() == "0", 10, what="the first labels")
    yield agent, backend, sink
    agent.stop_event.set()
    t.join(timeout=10)
    assert not t.is_alive()


def test_an_xid_reaches_the_labels_at_once_not_at_the_next_reconcile(
    running: tuple[Agent, SimulatedBackend, TimedSink],
) -> None:
    agent, backend, sink = running
    before = len(sink.applied)
    t0 = time.monotonic()
    backend.inject(3, FaultSpec(kind="xid", xid=79))
    wait_for(lambda: sink.unhealthy() == "1", 2, what="GPU 3 quarantined")
    at, ls = sink.applied[-1]
    assert at - t0 < 1.0  # the telemetry poll is every second: an event, not a poll
    assert len(sink.applied) == before + 1  # one out-of-turn reconcile
    gpus = {g.index: g for g in decode_gpus(ls.annotations["gpudaemon.io/gpus"])}
    assert not gpus[3].healthy and gpus[3].action == "reboot_node"
    assert all(g.healthy for i, g in gpus.items() if i != 3)
    hist = agent.registry.get_sample_value("gpudaemon_quarantine_seconds_count", {"trigger": "xid"})
    assert hist == 1.0


def test_an_xid_storm_is_one_reconcile(
    running: tuple[Agent, SimulatedBackend, TimedSink],
) -> None:
    _agent, backend, sink = running
    before = len(sink.applied)
    backend.inject(5, FaultSpec(kind="xid", xid=79, count=5000))
    wait_for(lambda: sink.unhealthy() == "1", 2, what="GPU 5 quarantined")
    wait_for(
        lambda: backend.sample()[5].xid_errors_total.get(79) == 5000, 5, what="5,000 events counted"
    )
    backend.inject(5, FaultSpec(kind="xid", xid=79, count=3000))  # a second burst
    wait_for(
        lambda: backend.sample()[5].xid_errors_total.get(79) == 8000,
        10,
        what="8,000 events counted",
    )
    time.sleep(1.5)  # a negative check: no second write, over a telemetry poll or two
    assert len(sink.applied) == before + 1


def test_an_application_xid_wakes_nothing(
    running: tuple[Agent, SimulatedBackend, TimedSink],
) -> None:
    _agent, backend, sink = running
    before = len(sink.applied)
    backend.inject(1, FaultSpec(kind="xid", xid=13, count=100))
    wait_for(lambda: backend.sample()[1].xid_errors_total.get(13) == 100, 3, what="XIDs counted")
    time.sleep(1.5)  # a negative check: no write, over a telemetry poll or two
    assert len(sink.applied) == before
    assert sink.unhealthy() == "0"


def test_a_polled_fault_is_written_after_the_poll_that_finds_it(
    running: tuple[Agent, SimulatedBackend, TimedSink],
) -> None:
    agent, backend, sink = running
    backend.inject(2, FaultSpec(kind="row_remap", pending=True))
    wait_for(lambda: sink.unhealthy() == "1", 3, what="GPU 2 quarantined at the next poll")
    assert agent.registry.get_sample_value(
        "gpudaemon_quarantine_seconds_count", {"trigger": "poll"}
    )


class Fake:
    """Quarantine's collaborators: the unhealthy set, polls and reconciles counted."""

    def __init__(self) -> None:
        self.bad: frozenset[str] = frozenset()
        self.polls = 0
        self.reconciles = 0
        self.q = Quarantine(self.poll, self.reconcile, lambda: self.bad, min_poll_interval_s=0)

    def poll(self) -> None:
        self.polls += 1

    def reconcile(self) -> None:
        self.reconciles += 1
        self.q.published(self.bad)


def test_a_gpu_turning_better_is_not_written_out_of_turn() -> None:
    f = Fake()
    f.q.published(frozenset({"GPU-a"}))
    f.bad = frozenset()  # healthy again: the regular reconcile releases it
    f.q.after_poll()
    assert f.q.step() is False
    assert f.reconciles == 0


def test_nothing_before_the_first_reconcile_and_news_after_it() -> None:
    f = Fake()
    f.bad = frozenset({"GPU-a"})
    f.q.after_poll()
    assert f.q.step() is False  # the first reconcile writes everything anyway
    f.q.published(frozenset())
    f.q.after_poll()
    assert f.q.step() is True and f.reconciles == 1
    f.q.after_poll()
    assert f.q.step() is False and f.reconciles == 1  # written: no news


def test_a_repeated_critical_xid_does_not_poll_again_until_the_gpu_is_released() -> None:
    f = Fake()
    f.q.published(frozenset())
    f.q.on_xid(0, 79)
    f.q.step()
    f.q.on_xid(0, 79)
    f.q.step()
    assert f.polls == 1
    f.q.on_xid(0, 154)  # the recovery action changed: always read it
    f.q.step()
    assert f.polls == 2
    f.q.published(frozenset({"GPU-x"}))
    f.q.published(frozenset())  # released (a reset): the XID is news again
    f.q.on_xid(0, 79)
    f.q.step()
    assert f.polls == 3


def test_the_simulated_event_set_delivers_timed_faults_without_a_poll() -> None:
    """The event loop, fed by the simulator's event set: an XID fault due in 0.3 s
    arrives then, with no sample taken."""
    backend = SimulatedBackend(load_profile("dgx-h100"))
    got: list[tuple[float, int, int]] = []
    t0 = time.monotonic()
    backend.subscribe(lambda i, x: got.append((time.monotonic() - t0, i, x)))
    backend.inject(4, FaultSpec(kind="xid", xid=48, after_s=0.3))
    try:
        wait_for(lambda: got, 3, what="the XID event")
        at, index, xid = got[0]
        assert (index, xid) == (4, 48)
        assert 0.25 <= at < 1.0
        assert backend.sample()[4].xid_errors_total == {48: 1}
    finally:
        backend.close()


def test_the_loop_stops_and_frees_the_set() -> None:
    events = SimEventSet(2, lambda: None)
    stop = threading.Event()
    seen: list[tuple[int, int]] = []
    t = threading.Thread(
        target=xid_event_loop, args=(events, events.handles, stop, lambda i, x: seen.append((i, x)))
    )
    t.start()
    events.post(1, 79, 3)
    wait_for(lambda: len(seen) == 3, 2, what="three events")
    stop.set()
    t.join(timeout=3)
    assert not t.is_alive() and seen == [(1, 79)] * 3
