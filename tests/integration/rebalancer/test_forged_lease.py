"""A forged rebalancer Lease (renewTime 2099, leaseDurationSeconds 2**31 - 1, and a
reservation until 2100 for a pending pod) against real servers: the extender keeps no
room for it, so an 8-GPU pod binds on the node it names; and a real `gpudaemon
rebalance` process takes the Lease over within its own lease duration plus 5 s, as
from a leader that died."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from gpudaemon.cluster import reservations
from tests.integration.rebalancer.rig import RebalanceRig, metric
from tests.integration.scheduler.rig import NS
from tests.support import wait_for

pytestmark = pytest.mark.integration

LEASES = "/apis/coordination.k8s.io/v1/namespaces/gpudaemon/leases"
LEASE = f"{LEASES}/gpudaemon-rebalancer"
FOREVER = "2099-01-01T00:00:00.000000Z"


def forged(holder_uid: str, node: str) -> dict[str, Any]:
    room = [{"uid": holder_uid, "pod": f"{NS}/holder", "node": node, "gpus": 8,
             "priority": 0, "until": 4102444800}]  # fmt: skip
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": "gpudaemon-rebalancer",
                     "annotations": {"gpudaemon.io/reservations": json.dumps(room)}},
        "spec": {"holderIdentity": "forged", "leaseDurationSeconds": 2**31 - 1,
                 "renewTime": FOREVER, "acquireTime": FOREVER},
    }  # fmt: skip


def test_a_forged_lease_keeps_no_room_and_a_real_rebalancer_takes_it_over(
    rig: RebalanceRig, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = "forge-0"
    rig.add_node(node, "forge")
    rig.run_agents([node])
    rig.wait_extender_sees([node])
    # A pending 8-GPU pod that fits nowhere (no node of its group), named by the forgery.
    rig.create_pod(8, "nowhere", name="holder")
    uid = rig.pod("holder")["metadata"]["uid"]
    ext = rig.extender
    assert ext is not None
    # What the extender's reservations read of each event of that Lease: the informer
    # holds its handler from the start, so the reading is observed, not the handler.
    seen: list[str] = []
    real = reservations.lease_held_until

    def held_until(obj: Any, now: float) -> float | None:
        seen.append(str((obj.get("spec") or {}).get("holderIdentity")))
        return real(obj, now)

    monkeypatch.setattr(reservations, "lease_held_until", held_until)
    rig.cp.admin.request("POST", LEASES, body=forged(uid, node))
    wait_for(lambda: "forged" in seen, 10, what="the extender to see the forged Lease")

    # No room is kept for the holder: an 8-GPU pod binds on the node the forgery names.
    rig.create_pod(8, "forge", name="victim")
    assert rig.wait_bound("victim", timeout=60) == node
    assert ext.reservations.in_force(time.time()) == {}

    # A real rebalancer takes the forged Lease over within its duration plus 5 s.
    duration = 6
    started = time.monotonic()
    url = rig.start_rebalancer("rb-real", apply=False, lease_duration_s=duration)

    def holder() -> str:
        return str(rig.cp.admin.request("GET", LEASE)["spec"].get("holderIdentity") or "")

    try:
        wait_for(lambda: holder().startswith("rb-real"), duration + 5, interval=0.05,
                 what="the real rebalancer leading")  # fmt: skip
    except AssertionError as e:
        raise AssertionError(f"{e}\n{rig.rebalancer_log('rb-real')[-3000:]}") from None
    took = time.monotonic() - started
    assert took <= duration + 5, took
    spec = rig.cp.admin.request("GET", LEASE)["spec"]
    assert spec["leaseDurationSeconds"] == duration and not spec["renewTime"].startswith("2099")
    wait_for(lambda: metric(url, "gpudaemon_rebalancer_leader") == 1, 10, what="leader metric")
    rig.stop_rebalancers()
    for pod in ("holder", "victim"):
        rig.delete(f"/api/v1/namespaces/{NS}/pods/{pod}")
