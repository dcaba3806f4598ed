"""The rebalancer's reservations (issue 28): kept on its own Lease, written before it
evicts, capped in number and time, released when the pod binds or goes, when they run
out, and when it stops leading; the pod annotation is only a mirror."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from gpudaemon.config import Config
from gpudaemon.errors import KubeUnavailableError
from gpudaemon.kube.lease import micro_time
from tests.unit.rebalancer.fake_kube import FakeKube
from tests.unit.rebalancer.test_rebalancer import load, metric, node, pod, rig

LEASE = "gpudaemon-rebalancer"
KEY = "gpudaemon.io/reservations"


def on_lease(kube: FakeKube) -> list[dict[str, Any]]:
    ann = kube.leases[LEASE]["metadata"].get("annotations") or {}
    return list(json.loads(ann.get(KEY, "[]")))


class Recording(FakeKube):
    """Keeps what the Lease said at each real (not dry-run) eviction."""

    def __init__(self) -> None:
        super().__init__()
        self.at_eviction: list[list[dict[str, Any]]] = []

    def request(self, method: str, path: str, body: Any = None, query: Any = None,
                **kw: Any) -> dict[str, Any]:  # fmt: skip
        if path.endswith("/eviction") and (query or {}).get("dryRun") != "All":
            self.at_eviction.append(on_lease(self))
        return super().request(method, path, body, query, **kw)


NODES = [node(f"n{i}") for i in range(1, 5)]
RUNNING = [pod(f"n{i}-p{j}", f"n{i}") for i in range(1, 5) for j in range(6)]
BIG = pod("big", gpus=8, unschedulable=True)


def test_the_reservation_is_on_the_lease_before_any_eviction() -> None:
    kube = Recording()
    rb, _, clock = rig(apply=True, kube=kube)
    load(rb, clock, NODES, RUNNING, [BIG])
    rb.run_pass()
    assert len(kube.at_eviction) == 6
    target = kube.evictions[-1][0].split("/")[1].split("-")[0]
    for seen in kube.at_eviction:
        assert seen == [{"uid": "uid-big", "pod": "ml/big", "node": target, "gpus": 8,
                         "priority": 0, "until": clock() + 300}]  # fmt: skip
    # The pod's own annotation: a mirror for people, written too.
    [(name, patch)] = kube.patches
    assert (
        name == "big" and patch["metadata"]["annotations"]["gpudaemon.io/reserved-node"] == target
    )


def test_released_when_the_pod_binds_or_goes_or_runs_out() -> None:
    rb, kube, clock = rig(apply=True)
    load(rb, clock, NODES, RUNNING, [BIG])
    rb.run_pass()
    assert [r["uid"] for r in on_lease(kube)] == ["uid-big"]
    rb._pending_event("MODIFIED", pod("big", "n1", gpus=8))  # bound
    assert rb.elector.try_acquire_or_renew()
    assert on_lease(kube) == []

    rb, kube, clock = rig(apply=True)
    load(rb, clock, NODES, RUNNING, [BIG])
    rb.run_pass()
    rb._pending_event("DELETED", BIG)
    rb.elector.try_acquire_or_renew()
    assert on_lease(kube) == []

    rb, kube, clock = rig(apply=True)
    load(rb, clock, NODES, RUNNING, [BIG])
    rb.run_pass()
    clock.advance(299)
    rb.elector.try_acquire_or_renew()
    assert len(on_lease(kube)) == 1
    clock.advance(1)
    rb.elector.try_acquire_or_renew()
    assert on_lease(kube) == []


def test_no_force_once_it_stops_leading() -> None:
    rb, kube, clock = rig(apply=True)
    load(rb, clock, NODES, RUNNING, [BIG])
    rb.run_pass()
    rb.close()  # releases the Lease: no holder, so the extender keeps nothing
    lease = kube.leases[LEASE]
    assert lease["spec"]["holderIdentity"] == "" and on_lease(kube) == []
    # A replica that loses the Lease to another drops its own at once.
    rb2, kube2, clock2 = rig(apply=True)
    load(rb2, clock2, NODES, RUNNING, [BIG])
    rb2.run_pass()
    assert rb2.reservations
    kube2.leases[LEASE]["spec"].update(holderIdentity="rb-b", renewTime=micro_time(clock2()))
    clock2.advance(11)  # past its renew deadline (10 s of 15)
    rb2.stop_event = OneRound()  # type: ignore[assignment]
    rb2.loop()
    assert rb2.reservations == {}


class OneRound:
    """A stop event that lets the loop run one round."""

    def __init__(self) -> None:
        self.rounds = 0

    def is_set(self) -> bool:
        self.rounds += 1
        return self.rounds > 1

    def wait(self, timeout: float | None = None) -> bool:
        return False


def test_at_most_max_reservations_live() -> None:
    other = pod("other", gpus=8, unschedulable=True)
    # Of lower priority than `big`, so its room is no bar to big's plan (`reserved`).
    other["spec"]["priority"] = -1
    rb, kube, clock = rig(apply=True, max_reservations=1)
    load(rb, clock, NODES, RUNNING, [BIG, other])
    rb.passes.reserve(rb.pending["uid-other"], "n4")  # a room already kept
    rb.run_pass()
    assert [k for k, dry in kube.evictions if not dry] == []
    assert metric(rb, "gpudaemon_rebalancer_skipped_total", kind="defrag",
                  reason="max_reservations") == 1  # fmt: skip
    rb._pending_event("DELETED", other)  # released: now there is room for one more
    rb.run_pass()
    assert len([k for k, dry in kube.evictions if not dry]) == 6


def test_a_failed_lease_write_evicts_nothing_and_keeps_no_reservation() -> None:
    rb, kube, clock = rig(apply=True)
    load(rb, clock, NODES, RUNNING, [BIG])

    def refuse_puts(method: str, path: str, *a: Any, **kw: Any) -> dict[str, Any]:
        if method == "PUT":
            raise KubeUnavailableError("connection refused")
        return FakeKube.request(kube, method, path, *a, **kw)

    kube.request = refuse_puts  # type: ignore[method-assign]
    rb.run_pass()
    assert [k for k, dry in kube.evictions if not dry] == []
    assert rb.reservations == {}


@pytest.mark.parametrize("bad", [{"reserve_s": 601}, {"max_reservations": 0},
                                 {"max_reservations": 257}])  # fmt: skip
def test_the_caps_are_bounded_in_config(bad: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        Config.model_validate({"node_name": "t", "rebalance": bad})
