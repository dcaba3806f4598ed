"""The room the rebalancer made for a pending pod is kept for it (issues 22, 28), and
only when the rebalancer said so on its own Lease: a pod's annotations keep nothing;
other pods of no higher priority are turned away from that node while the Lease is
held, the reservation is unexpired and its pod is still pending. A bad Lease value
keeps nothing and raises nothing."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gpudaemon.cluster.reservations import (
    MAX_RESERVATIONS,
    LeaseReservations,
    Reservation,
    ReservationCollector,
    decode,
    encode,
)
from gpudaemon.extender.api import ExtenderApi
from gpudaemon.extender.pods import PendingPods, PodVerifier
from gpudaemon.kube.lease import micro_time
from tests.clock import T0
from tests.unit.extender.test_api import call, make_api
from tests.unit.extender.test_pods import SCHED, Api, ours

NAMES = ["a", "b", "c"]  # free GPUs: a 2, b 6, c 8 (make_api)


def lease(
    entries: list[dict[str, Any]] | str | None,
    renewed: float = T0,
    duration: int = 15,
    holder: str = "rb-a",
    name: str = "gpudaemon-rebalancer",
) -> dict[str, Any]:
    ann = {}
    if entries is not None:
        ann["gpudaemon.io/reservations"] = (
            entries if isinstance(entries, str) else orjson.dumps(entries).decode()
        )
    return {
        "metadata": {"name": name, "namespace": "gpudaemon", "annotations": ann},
        "spec": {
            "holderIdentity": holder,
            "renewTime": micro_time(renewed),
            "leaseDurationSeconds": duration,
        },
    }


def entry(uid: str = "big", node: str = "c", until: float = T0 + 300, **kw: Any) -> dict[str, Any]:
    return {"uid": uid, "pod": f"default/{uid}", "node": node, "gpus": 8, "priority": 5,
            "until": until, **kw}  # fmt: skip


def pending_pod(uid: str, gpus: int, priority: int = 0, **ann: str) -> dict[str, Any]:
    p = ours(uid, gpus)
    p["spec"]["priority"] = priority
    if ann:
        p["metadata"]["annotations"] = ann
    return p


class Rig:
    """make_api's cluster, a verifier over a pending cache, and the Lease reader."""

    def __init__(self, *pending: dict[str, Any]) -> None:
        self.pending = PendingPods("gpudaemon.io/gpu.product")
        self.pending.replace(list(pending))
        self.reservations = LeaseReservations(wall=lambda: T0)
        v = PodVerifier(self.pending, Api(), SCHED)
        self.api: ExtenderApi
        self.api, self.cluster, self.reg = make_api(verifier=v, reservations=self.reservations)

    def passed(self, pod: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
        code, out = call(self.api, "/filter", orjson.dumps({"Pod": pod, "NodeNames": NAMES}))
        assert code.startswith("200"), out
        return out["NodeNames"], out["FailedNodes"]


BIG = pending_pod("big", 8, priority=5)
SMALL = pending_pod("small", 1)


def test_forged_pod_annotations_keep_no_room() -> None:
    """A tenant's pending pod saying "reserved on c, for ever": nothing is kept."""
    forged = pending_pod("forger", 1, priority=100, **{
        "gpudaemon.io/reserved-node": "c", "gpudaemon.io/reserved-until": "9999999999"})  # fmt: skip
    rig = Rig(forged, SMALL)
    assert rig.passed(SMALL)[0] == NAMES
    # Not even with a held rebalancer Lease that names other pods only.
    rig.reservations.event("ADDED", lease([entry(uid="someone-else")]))
    assert rig.passed(SMALL)[0] == NAMES


def test_lease_reservation_keeps_room_from_lower_priority_pods_not_from_its_own() -> None:
    rig = Rig(BIG, SMALL, pending_pod("urgent", 1, priority=6))
    rig.reservations.event("ADDED", lease([entry()]))
    passed, failed = rig.passed(SMALL)
    assert passed == ["a", "b"]
    assert "8 GPU(s) kept for pending pod default/big" in failed["c"]
    assert rig.passed(BIG)[0] == ["c"]  # the reserved pod itself takes it
    assert rig.passed(pending_pod("urgent", 1, priority=6))[0] == NAMES  # higher priority
    v = rig.reg.get_sample_value("gpudaemon_extender_filter_nodes_total", {"result": "reserved"})
    assert v == 1


def test_the_pods_own_priority_counts_not_the_body_s() -> None:
    rig = Rig(BIG, SMALL)
    rig.reservations.event("ADDED", lease([entry()]))
    liar = pending_pod("small", 1, priority=1000)  # the body says 1000; the API says 0
    assert rig.passed(liar)[0] == ["a", "b"]


@pytest.mark.parametrize(
    ("what", "lease_obj", "pending"),
    [
        ("expired", lease([entry(until=T0 - 1)]), [BIG, SMALL]),
        ("lease run out", lease([entry()], renewed=T0 - 16), [BIG, SMALL]),
        ("lease released", lease([entry()], holder=""), [BIG, SMALL]),
        ("pod bound or gone", lease([entry()]), [SMALL]),
        ("another Lease", lease([entry()], name="node-c"), [BIG, SMALL]),
        ("no annotation", lease(None), [BIG, SMALL]),
    ],
)
def test_nothing_is_kept_when(what: str, lease_obj: dict[str, Any], pending: list[Any]) -> None:
    rig = Rig(*pending)
    rig.reservations.event("ADDED", lease_obj)
    assert rig.passed(SMALL)[0] == NAMES, what


def test_released_as_the_pod_binds_and_when_the_lease_goes() -> None:
    rig = Rig(BIG, SMALL)
    rig.reservations.replace([lease([entry()])])
    assert rig.passed(SMALL)[0] == ["a", "b"]
    rig.pending.event("MODIFIED", {**BIG, "spec": {**BIG["spec"], "nodeName": "c"}})
    assert rig.passed(SMALL)[0] == NAMES
    rig.pending.event("ADDED", BIG)
    assert rig.passed(SMALL)[0] == ["a", "b"]
    rig.reservations.event("DELETED", lease([entry()]))
    assert rig.passed(SMALL)[0] == NAMES
    rig.reservations.event("ADDED", lease([entry()]))
    rig.reservations.replace([])  # a relist without it
    assert rig.passed(SMALL)[0] == NAMES


def test_a_reservation_past_the_reserve_cap_is_ignored_and_the_others_kept() -> None:
    """No rebalancer reserves for more than MAX_RESERVE_S (600 s); a minute of clock
    skew is allowed beside it."""
    r = LeaseReservations(wall=lambda: T0)
    r.event("ADDED", lease([entry(uid="far", until=T0 + 10**9), entry(uid="late", until=T0 + 700),
                            entry(uid="ok", until=T0 + 600), entry(uid="skew", until=T0 + 650)]))  # fmt: skip
    assert [h.uid for h in r.in_force(T0)["c"]] == ["ok", "skew"]


FORGED = [
    ("renewTime in 2099", lease([entry()], renewed=4_070_908_800.0)),
    ("renewTime 61 s ahead", lease([entry()], renewed=T0 + 61)),
    ("duration 2**31 - 1", lease([entry()], duration=2**31 - 1)),
    ("duration over an hour", lease([entry()], duration=3601)),
    ("duration 0", lease([entry()], duration=0)),
    ("both, as the attack wrote it",
     lease([entry(until=4_102_444_800.0)], renewed=4_070_908_800.0, duration=2**31 - 1)),
]  # fmt: skip


@pytest.mark.parametrize(("what", "obj"), FORGED, ids=[f[0] for f in FORGED])
def test_a_lease_out_of_our_bounds_is_not_held_and_keeps_no_room(what: str, obj: Any) -> None:
    rig = Rig(BIG, SMALL)
    rig.reservations.event("ADDED", obj)
    assert rig.reservations.in_force(T0) == {}, what
    assert rig.passed(SMALL)[0] == NAMES, what


def test_a_renewal_within_a_minute_of_skew_is_held() -> None:
    r = LeaseReservations(wall=lambda: T0)
    r.event("ADDED", lease([entry()], renewed=T0 + 59))
    assert [h.uid for h in r.in_force(T0)["c"]] == ["big"]


HOSTILE: list[tuple[str, object]] = [
    ("not JSON", "{not json"),
    ("an object", '{"uid": "big"}'),
    ("deep nesting", "[" * 100_000 + "]" * 100_000),
    ("too large", " " * 70_000 + orjson.dumps([entry()]).decode()),
    ("too many", orjson.dumps([entry(uid=f"u{i}") for i in range(MAX_RESERVATIONS + 1)]).decode()),
    ("a number entry", "[1]"),
    ("gpus a bool", orjson.dumps([entry(gpus=True)]).decode()),
    ("gpus a string", orjson.dumps([entry(gpus="8")]).decode()),
    ("priority huge", orjson.dumps([entry(priority=2**40)]).decode()),
    ("until a string", orjson.dumps([entry(until="soon")]).decode()),
    ("until null", orjson.dumps([entry(until=None)]).decode()),
    ("node not a Node name", orjson.dumps([entry(node="Not_A_Node")]).decode()),
    ("node huge", orjson.dumps([entry(node="n" * 300)]).decode()),
    ("uid empty", orjson.dumps([entry(uid="")]).decode()),
    ("uid a list", orjson.dumps([entry(uid=["x"])]).decode()),
    ("pod missing", orjson.dumps([{k: v for k, v in entry().items() if k != "pod"}]).decode()),
]


@pytest.mark.parametrize(("what", "text"), HOSTILE, ids=[w for w, _ in HOSTILE])
def test_a_bad_value_means_no_reservations_counted_never_an_exception(
    what: str, text: object
) -> None:
    with pytest.raises(ValueError):
        decode(text)
    rig = Rig(BIG, SMALL)
    rig.reservations.event("ADDED", lease(text if isinstance(text, str) else None))
    assert rig.passed(SMALL)[0] == NAMES
    assert rig.reservations.rejected == 1
    rig.reservations.event("MODIFIED", lease(text if isinstance(text, str) else None))
    assert rig.reservations.rejected == 1  # the same text on renewal: not decoded again


def test_hostile_lease_objects_raise_nothing() -> None:
    r = LeaseReservations()
    for obj in (
        {},
        {"metadata": None},
        {"metadata": {"name": "gpudaemon-rebalancer", "annotations": ["x"]}, "spec": "x"},
        {
            "metadata": {
                "name": "gpudaemon-rebalancer",
                "annotations": {"gpudaemon.io/reservations": 5},
            },
            "spec": {
                "holderIdentity": "x",
                "renewTime": micro_time(T0),
                "leaseDurationSeconds": 15,
            },
        },
        lease([entry()], duration="15"),  # type: ignore[arg-type]
    ):
        r.event("ADDED", obj)
        assert r.in_force(T0) == {}


def test_round_trip_indexed_by_node_and_the_metrics() -> None:
    items = [
        Reservation("u1", "ml/one", "n1", 8, 0, T0 + 60),
        Reservation("u2", "ml/two", "n1", 2, 3, T0 + 90),
        Reservation("u3", "ml/three", "n2", 1, 0, T0 + 30),
        Reservation("u1", "ml/one", "n9", 8, 0, T0 + 60),  # the same pod again: dropped
    ]
    assert decode(encode(items)) == items[:3]
    r = LeaseReservations()
    r.event("ADDED", lease(encode(items)))
    by_node = r.in_force(T0)
    assert {n: [x.uid for x in v] for n, v in by_node.items()} == {"n1": ["u1", "u2"], "n2": ["u3"]}
    assert r.in_force(T0 + 15) == {}  # the Lease ran out
    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry()
    reg.register(ReservationCollector(r, wall=lambda: T0))
    assert reg.get_sample_value("gpudaemon_extender_reservations") == 3
    assert reg.get_sample_value("gpudaemon_extender_reservations_rejected_total") == 0
