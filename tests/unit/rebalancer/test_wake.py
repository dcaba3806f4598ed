"""A verdict acted on when it arrives: a Node event showing a GPU that newly needs a
drain wakes the leader's loop for a drain-only pass (no wait for rebalance.interval_s),
a sick GPU's grace ending before the next pass gets a drain pass at that moment, and
Node events that add no sick GPU wake nothing (and cost no decode when the annotation
is unchanged). The loop runs on real clocks here, with the fake API."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from gpudaemon.config import Config
from gpudaemon.kube.informer import Reflector
from gpudaemon.rebalancer import wake
from gpudaemon.rebalancer.app import Rebalancer
from gpudaemon.rebalancer.wake import SickWatch
from tests.support import wait_for
from tests.unit.extender.test_cluster import lease_obj
from tests.unit.rebalancer.fake_kube import FakeKube
from tests.unit.rebalancer.test_drain_actions import verdict_node
from tests.unit.rebalancer.test_rebalancer import P, load, metric, node, pod, rig
from tests.unit.rebalancer.test_reservations import BIG, NODES, RUNNING

INTERVAL_S = 30.0  # no regular pass runs after the first one within a test


class TimedKube(FakeKube):
    """The fake API, noting when (monotonic) each eviction request came."""

    def __init__(self) -> None:
        super().__init__()
        self.evicted_at: list[float] = []

    def request(self, method: str, path: str, body: Any = None, query: Any = None,
                **kw: Any) -> dict[str, Any]:  # fmt: skip
        out = super().request(method, path, body, query, **kw)
        if path.endswith("/eviction"):
            self.evicted_at.append(time.monotonic())
        return out


def live(grace_s: float, nodes: list[dict[str, Any]], running: list[dict[str, Any]],
         **rebalance: Any) -> tuple[Rebalancer, TimedKube]:  # fmt: skip
    """A rebalancer on real clocks, its watches synced with `nodes` and `running`."""
    kube = TimedKube()
    cfg = Config.model_validate({"node_name": "test", "rebalance": {
        "dry_run": False, "grace_s": grace_s, "interval_s": INTERVAL_S, **rebalance}})  # fmt: skip
    rb = Rebalancer(cfg, "rb-a", client=kube, registry=CollectorRegistry())  # type: ignore[arg-type]
    nodes_watch(rb).on_replace(nodes)
    rb.cluster.replace_pods(running)
    rb.cluster.replace_leases([lease_obj(n["metadata"]["name"], time.time(), 300,
                                         n["metadata"]["uid"]) for n in nodes])  # fmt: skip
    for r in rb.reflectors:
        r.synced.set()
    return rb, kube


def nodes_watch(rb: Rebalancer) -> Reflector:
    [r] = [r for r in rb.reflectors if r.kind == "nodes"]
    return r


Loop = Callable[[Rebalancer], None]


@pytest.fixture
def loop() -> Iterator[Loop]:
    """Runs a rebalancer's loop in a thread; at the end stops it as the SIGTERM handler
    does (stop_event only, no wake) and checks that it ended within a second."""
    running: list[tuple[Rebalancer, threading.Thread]] = []

    def start(rb: Rebalancer) -> None:
        t = threading.Thread(target=rb.loop, name="rebalance-loop", daemon=True)
        t.start()
        running.append((rb, t))

    yield start
    for rb, _ in running:
        rb.stop_event.set()
    asked = time.monotonic()
    for _, t in running:
        t.join(2)
    assert not any(t.is_alive() for _, t in running)
    assert time.monotonic() - asked < 1.0


def first_pass(rb: Rebalancer) -> None:
    wait_for(lambda: metric(rb, "gpudaemon_rebalancer_passes_total") >= 1, 5, interval=0.01,
             what="the first regular pass")  # fmt: skip


SICK = [("unhealthy", "reset_gpu", ["ml/a"]), ("healthy", "none", [])]
HEALTHY = [("healthy", "none", ["ml/a"]), ("healthy", "none", [])]


def test_a_node_event_making_a_gpu_sick_drains_at_once_not_at_the_next_pass(
    loop: Loop,
) -> None:
    rb, kube = live(0, [verdict_node("n1", HEALTHY), node("n2")], [pod("a", "n1")])
    loop(rb)
    first_pass(rb)
    sent = time.monotonic()
    nodes_watch(rb).on_event("MODIFIED", verdict_node("n1", SICK))
    wait_for(lambda: kube.evicted_at, 5, interval=0.01, what="the eviction")
    assert kube.evictions == [("ml/a", False)]
    assert kube.evicted_at[0] - sent < 1.0  # the interval is 30 s
    # A drain-only pass, counted as a pass; the regular one is still 30 s away.
    assert metric(rb, "gpudaemon_rebalancer_passes_total") == 2


@pytest.mark.parametrize("sick_from", ["a node event", "the first pass"])
def test_the_drain_comes_when_the_grace_runs_out_not_at_the_next_pass(
    loop: Loop, sick_from: str
) -> None:
    grace = 1.5
    start = SICK if sick_from == "the first pass" else HEALTHY
    rb, kube = live(grace, [verdict_node("n1", start), node("n2")], [pod("a", "n1")])
    loop(rb)
    sent = time.monotonic()
    if sick_from == "a node event":
        first_pass(rb)
        sent = time.monotonic()
        nodes_watch(rb).on_event("MODIFIED", verdict_node("n1", SICK))
    wait_for(lambda: kube.evicted_at, grace + 5, interval=0.01, what="the eviction")
    late = kube.evicted_at[0] - sent - grace
    assert 0 <= late < 1.0, late
    assert kube.evictions == [("ml/a", False)]


def test_a_drain_pass_makes_no_room_and_keeps_the_plans_blocked_pods() -> None:
    """BIG fits nowhere: a regular pass makes room for it, a drain-only pass does not,
    and the blocked-pods gauge keeps what the last plan could not evict."""
    rb, kube = live(0, NODES, RUNNING)
    rb.elector.try_acquire_or_renew()
    rb._pending_replace([BIG])
    rb.run_drain_pass()
    assert kube.evictions == []
    kube.refuse.update(f"ml/n{i}-p0" for i in range(1, 5))  # a PDB on a victim of each plan
    rb.run_pass()
    assert metric(rb, "gpudaemon_rebalancer_blocked_pods") == 6
    rb.run_drain_pass()
    assert metric(rb, "gpudaemon_rebalancer_blocked_pods") == 6
    kube.refuse.clear()
    rb.passes.made_room_for.clear()
    rb.run_pass()
    assert len([k for k, dry in kube.evictions if not dry]) == 6
    assert metric(rb, "gpudaemon_rebalancer_passes_total") == 4


def annotated(name: str, gpus: list[dict[str, Any]], rv: str = "1") -> dict[str, Any]:
    obj = node(name, gpus=len(gpus))
    obj["metadata"]["resourceVersion"] = rv
    obj["metadata"]["annotations"][P + "gpus"] = json.dumps(gpus)
    return obj


def gpu(i: int, action: str = "none", util: int = 0) -> dict[str, Any]:
    healthy = action in ("none", "watch")
    state = {"none": "healthy", "watch": "degraded"}.get(action, "unhealthy")
    return {"index": i, "uuid": f"GPU-{i}", "memory_total_mib": 81559, "healthy": healthy,
            "state": state, "action": action, "utilization_pct": util}  # fmt: skip


OK2 = [gpu(0), gpu(1)]
ONE_SICK = [gpu(0, "reset_gpu"), gpu(1)]


@pytest.mark.parametrize(
    ("before", "after", "wakes"),
    [
        pytest.param(OK2, OK2, False, id="unchanged annotation (a heartbeat)"),
        pytest.param(OK2, [gpu(0, util=90), gpu(1, util=40)], False, id="healthy, readings moved"),
        pytest.param(OK2, [gpu(0, "watch"), gpu(1)], False, id="degraded: watch"),
        pytest.param(ONE_SICK, [gpu(0, "reset_gpu", util=5), gpu(1)], False,
                     id="already sick, readings moved"),
        pytest.param(ONE_SICK, [gpu(0, "reboot_node"), gpu(1)], False,
                     id="already sick, another action"),
        pytest.param(ONE_SICK, OK2, False, id="sick GPU healthy again"),
        pytest.param(OK2, "not json", False, id="unreadable annotation"),
        pytest.param(OK2, ONE_SICK, True, id="a GPU newly needs a drain"),
        pytest.param(ONE_SICK, [gpu(0, "reset_gpu"), gpu(1, "replace")], True,
                     id="a second GPU newly needs a drain"),
        pytest.param([gpu(0)], [gpu(0), gpu(1, "drain")], True, id="a new GPU needing a drain"),
    ],
)  # fmt: skip
def test_which_node_events_wake_the_loop(before: Any, after: Any, wakes: bool) -> None:
    rb, _ = live(300, [annotated("n1", before)], [])
    rb.wake.clear()
    obj = annotated("n1", before, "2")
    ann = after if isinstance(after, str) else json.dumps(after)
    obj["metadata"]["annotations"][P + "gpus"] = ann
    nodes_watch(rb).on_event("MODIFIED", obj)
    assert rb.wake.is_set() == wakes


def test_the_wake_comes_once_the_store_has_the_node() -> None:
    """The drain pass it starts must see the new verdict."""
    rb, _ = live(300, [annotated("n1", OK2)], [])
    seen: list[list[str]] = []

    class Noting(threading.Event):
        def set(self) -> None:
            _, gpus = rb.cluster.views().nodes["n1"]
            seen.append([g.action for g in gpus])
            super().set()

    rb.sick_watch.wake = Noting()
    nodes_watch(rb).on_event("MODIFIED", annotated("n1", ONE_SICK, "2"))
    assert seen == [["reset_gpu", "none"]]


def test_a_node_event_that_wakes_nothing_sets_nothing_in_the_loop(
    loop: Loop,
) -> None:
    rb, kube = live(0, [verdict_node("n1", SICK), node("n2")], [pod("a", "n1")])
    kube.refuse.add("ml/a")  # a PDB: the first pass's eviction is refused
    loop(rb)
    first_pass(rb)
    obj = verdict_node("n1", SICK)
    obj["metadata"]["labels"]["heartbeat"] = "2"
    nodes_watch(rb).on_event("MODIFIED", obj)  # the same verdict: no new drain
    time.sleep(0.5)  # a negative check: time for a pass that must not come
    assert metric(rb, "gpudaemon_rebalancer_passes_total") == 1


def test_deleted_nodes_are_forgotten_and_a_relist_wakes_only_for_new_sick_gpus() -> None:
    woke = threading.Event()
    w = SickWatch(P + "gpus", woke)
    w.replace([annotated("n1", ONE_SICK), annotated("n2", OK2)])
    assert woke.is_set()  # the first list: every sick GPU is new
    woke.clear()
    w.replace([annotated("n1", ONE_SICK), annotated("n2", OK2)])
    assert not woke.is_set()
    w.node_event("DELETED", annotated("n1", ONE_SICK))
    w.node_event("ADDED", annotated("n1", ONE_SICK))  # a new node of the same name
    assert woke.is_set()
    woke.clear()
    w.replace([annotated("n1", ONE_SICK)])  # n2 gone while the watch was down
    w.node_event("ADDED", annotated("n2", ONE_SICK))
    assert woke.is_set()


def test_an_unchanged_annotation_is_not_decoded_again(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def counting(text: object, key: str = "gpus") -> Any:
        calls.append(text)
        return real(text, key)

    real = wake.decode_gpus
    monkeypatch.setattr(wake, "decode_gpus", counting)
    w = SickWatch(P + "gpus", threading.Event())
    for rv in range(100):
        w.node_event("MODIFIED", annotated("n1", OK2, str(rv)))  # a fresh object each time
    assert len(calls) == 1


def test_a_close_wakes_a_waiting_loop_at_once() -> None:
    rb, _ = live(300, [node("n1")], [])
    t = threading.Thread(target=rb.loop, daemon=True)
    t.start()
    first_pass(rb)
    asked = time.monotonic()
    rb.close()
    t.join(2)
    assert not t.is_alive() and time.monotonic() - asked < 0.2


def test_a_burst_of_verdicts_is_a_few_drain_passes_each_evicting_a_pod_once(loop: Loop) -> None:
    """Here the pod watch never shows an evicted pod going: it is not evicted again."""
    names = [f"n{i}" for i in range(40)]
    rb, kube = live(0, [verdict_node(n, HEALTHY) for n in names],
                    [pod(f"a{i}", n) for i, n in enumerate(names)],
                    max_evictions_per_minute=1000)  # fmt: skip
    loop(rb)
    first_pass(rb)
    for i, n in enumerate(names):  # a rack losing power, over half a second
        nodes_watch(rb).on_event("MODIFIED", verdict_node(n, [
            ("unhealthy", "reboot_node", [f"ml/a{i}"]), ("healthy", "none", [])]))  # fmt: skip
        time.sleep(0.0125)  # the verdicts arrive spread over time, as in a rack
    wait_for(lambda: len(kube.evictions) >= len(names), 5, interval=0.01, what="every eviction")
    time.sleep(0.3)  # a negative check: time for another drain pass, were one coming
    assert metric(rb, "gpudaemon_rebalancer_passes_total") <= 1 + 4
    assert sorted(kube.evictions) == sorted((f"ml/a{i}", False) for i in range(len(names)))


def test_an_evicted_pod_is_not_evicted_again_while_the_watch_catches_up() -> None:
    rb, kube, clock = rig(apply=True, grace_s=0)
    load(rb, clock, [verdict_node("n1", SICK), node("n2")], [pod("a", "n1")])
    rb.run_drain_pass()
    clock.advance(1)
    rb.run_drain_pass()  # the pod watch has not shown ml/a terminating yet
    assert kube.evictions == [("ml/a", False)]
    clock.advance(60)  # still not going a minute later: evicted again
    rb.run_pass()
    assert kube.evictions == [("ml/a", False)] * 2
