"""The rebalancer drains a pod holding a sick GPU through an allocated DRA claim (the
agent's annotation does not name it: the claim and the slice do), through the eviction
API as a device-plugin pod; with DRA off it does not know the pod holds the GPU."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry

from gpudaemon.config import Config
from gpudaemon.rebalancer.app import Rebalancer
from tests.clock import FakeClock
from tests.dra_objects import claim, dra_pod, gpu_device, nvidia_slice
from tests.kubeobjects import OWNER
from tests.unit.rebalancer.fake_kube import FakeKube
from tests.unit.rebalancer.test_rebalancer import load, node


def rig(dra: bool) -> tuple[Rebalancer, FakeKube, FakeClock]:
    kube, clock = FakeKube(), FakeClock()
    cfg = Config.model_validate({"node_name": "test", "dra": {"enabled": dra},
                                 "rebalance": {"dry_run": False, "grace_s": 0}})  # fmt: skip
    rb = Rebalancer(cfg, "rb", client=kube, registry=CollectorRegistry(),  # type: ignore[arg-type]
                    clock=clock, wall=clock)  # fmt: skip
    assert rb.elector.try_acquire_or_renew()
    return rb, kube, clock


def running(uid: str, claim_name: str) -> dict[str, Any]:
    p = dra_pod(uid, [("gpu", f"claim:{claim_name}")], node="n1", ns="ml")
    p["metadata"]["ownerReferences"] = OWNER
    p["status"]["phase"] = "Running"
    return p


def cluster(rb: Rebalancer, clock: FakeClock) -> None:
    # n1's GPU 3 is sick (the agent's verdict, keyed by UUID); no holders in the annotation.
    n1 = node("n1", sick={3: []})
    load(rb, clock, [n1, node("n2")], [running("a", "ca"), running("b", "cb")])
    uuid = "GPU-n1-3"  # the slice device carries the UUID the agent reports
    devices = [gpu_device("n1", i) for i in range(8)]
    devices[3]["attributes"]["uuid"] = {"string": uuid}
    rb.cluster.dra_replace("resourceslices")([nvidia_slice("n1", devices=devices)])
    rb.cluster.dra_replace("resourceclaims")([
        claim("ca", 2, ns="ml", allocated=("n1", ["gpu-2", "gpu-3"]), reserved_for=["a"]),
        claim("cb", 1, ns="ml", allocated=("n1", ["gpu-4"]), reserved_for=["b"]),
    ])  # fmt: skip


def test_a_pod_holding_a_sick_gpu_through_a_claim_is_evicted() -> None:
    rb, kube, clock = rig(dra=True)
    cluster(rb, clock)
    rb.run_pass()
    assert kube.evictions == [("ml/a", False)]  # not b: its device is on a healthy GPU


def test_without_dra_the_claim_holder_is_unknown() -> None:
    rb, kube, clock = rig(dra=False)
    load(rb, clock, [node("n1", sick={3: []}), node("n2")], [running("a", "ca")])
    rb.run_pass()
    assert kube.evictions == []
