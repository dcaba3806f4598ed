"""Reservations only the rebalancer can make (issue 28), on a real etcd,
kube-apiserver and kube-scheduler with the extender:

1. a tenant's never-schedulable pods carrying the reservation annotations
   (`gpudaemon.io/reserved-node` / `-until`), as first written and renewed, keep no
   room from another tenant's 8-GPU pods: each tenant uses a token of its own
   ServiceAccount, allowed only pods in its own namespace;
2. a reservation on the rebalancer's Lease keeps its node from a lower-priority pod
   while the Lease is held, and not once it is released.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from gpudaemon.errors import KubeError
from gpudaemon.kube.client import Credentials, KubeClient
from gpudaemon.kube.lease import micro_time
from tests.integration.kube.controlplane import _kubeconfig
from tests.integration.scheduler.rig import GROUP, NS, SchedulerRig
from tests.support import wait_for

pytestmark = pytest.mark.integration

LEASES = "/apis/coordination.k8s.io/v1/namespaces/gpudaemon/leases"


def tenant(rig: SchedulerRig, ns: str, tmp: Path) -> tuple[str, KubeClient]:
    """A namespace and a ServiceAccount token that may manage pods there, nothing else."""
    admin = rig.cp.admin
    admin.request("POST", "/api/v1/namespaces", body={"metadata": {"name": ns}})
    admin.request("POST", f"/api/v1/namespaces/{ns}/serviceaccounts",
                  body={"metadata": {"name": "tenant"}})  # fmt: skip
    admin.request("POST", f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles", body={
        "metadata": {"name": "pods"},
        "rules": [{"apiGroups": [""], "resources": ["pods"],
                   "verbs": ["create", "get", "list", "patch", "update", "delete"]}],
    })  # fmt: skip
    admin.request("POST", f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings", body={
        "metadata": {"name": "pods"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pods"},
        "subjects": [{"kind": "ServiceAccount", "name": "tenant", "namespace": ns}],
    })  # fmt: skip
    tr = admin.request("POST", f"/api/v1/namespaces/{ns}/serviceaccounts/tenant/token",
                       body={"spec": {"expirationSeconds": 3600}})  # fmt: skip
    kc = _kubeconfig(tmp / f"{ns}.kubeconfig", rig.cp.server, ns, tr["status"]["token"], rig.cp.ca)
    return ns, KubeClient.from_credentials(Credentials(False, str(kc)))


def gpu_pod(name: str, gpus: int, group: str, **extra: Any) -> dict[str, Any]:
    res = {"cpu": "1", "memory": "1Gi", "nvidia.com/gpu": str(gpus)}
    meta = {"name": name, **extra.pop("meta", {})}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {
            "schedulerName": "gpudaemon-scheduler",
            "nodeSelector": {GROUP: group},
            "terminationGracePeriodSeconds": 0,
            "containers": [
                {
                    "name": "c",
                    "image": "example.invalid/x",
                    "resources": {"requests": res, "limits": {"nvidia.com/gpu": str(gpus)}},
                }
            ],
            **extra,
        },
    }


def bound_to(client: KubeClient, ns: str, name: str, timeout: float = 30) -> str:
    def node() -> str | None:
        return client.request("GET", f"/api/v1/namespaces/{ns}/pods/{name}")["spec"].get("nodeName")

    return str(wait_for(node, timeout, interval=0.1, what=f"{ns}/{name} bound"))


@pytest.fixture
def tenants(rig: SchedulerRig, tmp_path: Path) -> Iterator[list[tuple[str, KubeClient]]]:
    suffix = uuid.uuid4().hex[:5]
    out = [tenant(rig, f"tenant-{t}-{suffix}", tmp_path) for t in ("a", "b")]
    try:
        yield out
    finally:
        for _, c in out:
            c.close()


def test_forged_reservation_annotations_keep_no_room(
    rig: SchedulerRig, tenants: list[tuple[str, KubeClient]]
) -> None:
    (ns_a, a), (ns_b, b) = tenants
    nodes = ["forge-0", "forge-1"]
    for n in nodes:
        rig.add_node(n, "forge")
    rig.run_agents(nodes)
    rig.wait_extender_sees(nodes)
    assert rig.extender is not None

    # Tenant A: a 1-GPU pod on each node's behalf that can never be scheduled (its
    # node selector matches nothing), saying the rebalancer kept the node for it.
    def forge(i: int, until: float) -> dict[str, str]:
        return {
            "gpudaemon.io/reserved-node": nodes[i],
            "gpudaemon.io/reserved-until": f"{until:.0f}",
        }

    uids = []
    for i in range(2):
        body = gpu_pod(f"hog-{i}", 1, "nowhere", meta={"annotations": forge(i, time.time() + 3600)})
        uids.append(
            a.request("POST", f"/api/v1/namespaces/{ns_a}/pods", body=body)["metadata"]["uid"]
        )
    pending = rig.extender.pending
    wait_for(lambda: all(pending.get(u) for u in uids), 30, what="the extender to see the hogs")

    # Tenant B's 8-GPU pod: a whole node, which the forgery claimed to keep.
    b.request("POST", f"/api/v1/namespaces/{ns_b}/pods", body=gpu_pod("whole-0", 8, "forge"))
    first = bound_to(b, ns_b, "whole-0")

    # Tenant A renews its claims; B's second 8-GPU pod takes the other node all the same.
    for i in range(2):
        a.request("PATCH", f"/api/v1/namespaces/{ns_a}/pods/hog-{i}",
                  body={"metadata": {"annotations": forge(i, time.time() + 7200)}},
                  content_type="application/merge-patch+json")  # fmt: skip
    # A negative check: time for the watch to deliver the renewal, which keeps no room.
    time.sleep(1)
    b.request("POST", f"/api/v1/namespaces/{ns_b}/pods", body=gpu_pod("whole-1", 8, "forge"))
    second = bound_to(b, ns_b, "whole-1")
    assert {first, second} == set(nodes)
    for i in range(2):  # the hogs are still pending, still claiming
        hog = a.request("GET", f"/api/v1/namespaces/{ns_a}/pods/hog-{i}")
        assert not hog["spec"].get("nodeName")
        assert hog["metadata"]["annotations"]["gpudaemon.io/reserved-node"] == nodes[i]


def put_lease(rig: SchedulerRig, holder: str, reservations: list[dict[str, Any]]) -> None:
    """The rebalancer's Lease as its leader writes it (here by the test, as admin)."""
    body: dict[str, Any] = {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": "gpudaemon-rebalancer", "annotations": {
            "gpudaemon.io/reservations": orjson.dumps(reservations).decode()}},
        "spec": {"holderIdentity": holder, "leaseDurationSeconds": 60,
                 "renewTime": micro_time(time.time())},
    }  # fmt: skip
    try:
        old = rig.cp.admin.request("GET", f"{LEASES}/gpudaemon-rebalancer")
    except KubeError:
        rig.cp.admin.request("POST", LEASES, body=body)
        return
    body["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
    rig.cp.admin.request("PUT", f"{LEASES}/gpudaemon-rebalancer", body=body)


def test_a_reservation_on_the_rebalancers_lease_keeps_room_while_it_is_held(
    rig: SchedulerRig,
) -> None:
    assert rig.extender is not None
    nodes = ["resv-0", "resv-1"]
    for n in nodes:
        rig.add_node(n, "resv")
    rig.run_agents(nodes)
    rig.wait_extender_sees(nodes)
    admin = rig.cp.admin
    # resv-0 is the fuller node (bin-packing's pick) once a 2-GPU pod sits there.
    admin.request("POST", f"/api/v1/namespaces/{NS}/pods",
                  body=gpu_pod("resv-pinned", 2, "resv", nodeName="resv-0"))  # fmt: skip
    admin.request("POST", "/apis/scheduling.k8s.io/v1/priorityclasses",
                  body={"metadata": {"name": "resv-high"}, "value": 1000})  # fmt: skip
    # The pod the rebalancer made room for: pending (it selects no node yet), priority 1000.
    # The Priority admission plugin reads PriorityClasses from its informer: a pod made
    # at once may be refused ("no PriorityClass ... found") until it has the new one.
    big = wait_for(lambda: admin.request("POST", f"/api/v1/namespaces/{NS}/pods",
                   body=gpu_pod("resv-big", 6, "resv-later", priorityClassName="resv-high")),
                   10, what="resv-big admitted with its PriorityClass")  # fmt: skip
    uid = big["metadata"]["uid"]
    wait_for(lambda: rig.extender.pending.get(uid), 30, what="the extender to see resv-big")  # type: ignore[union-attr]
    entry = {"uid": uid, "pod": f"{NS}/resv-big", "node": "resv-0", "gpus": 6,
             "priority": 1000, "until": time.time() + 300}  # fmt: skip
    put_lease(rig, "rb-test", [entry])
    wait_for(lambda: rig.extender.reservations.in_force(time.time()), 10,  # type: ignore[union-attr]
             what="the extender to read the Lease")  # fmt: skip

    # Held: a 1-GPU pod of priority 0 is turned away from the kept node.
    rig.create_pod(1, "resv", name="resv-small-1")
    assert rig.wait_bound("resv-small-1") == "resv-1"

    # Released (no holder, as the rebalancer leaves it when it stops): nothing is kept,
    # and bin-packing's pick, the fuller resv-0, takes the next one.
    put_lease(rig, "", [entry])
    wait_for(lambda: not rig.extender.reservations.in_force(time.time()), 10,  # type: ignore[union-attr]
             what="the extender to see the release")  # fmt: skip
    rig.create_pod(1, "resv", name="resv-small-2")
    assert rig.wait_bound("resv-small-2") == "resv-0"
    rig.delete_pods(["resv-pinned", "resv-big", "resv-small-1", "resv-small-2"])
