"""MIG devices in the extender (issue 20): a pod's nvidia.com/mig-<profile> requests,
free devices per profile from allocatable minus bound and assumed pods, the filter's
reason, and MIG packing's order."""

from __future__ import annotations

from typing import Any

import pytest

from gpudaemon.cluster.clusterstate import ClusterState
from gpudaemon.cluster.podspec import pod_shape
from gpudaemon.cluster.policies.migpack import MigPack
from gpudaemon.cluster.scoring import check_node
from gpudaemon.cluster.state import NodeState, PodShape
from tests.clock import FakeClock

P = "gpudaemon.io/"


def mig_node(name: str, one_g: int = 7, three_g: int = 2, whole: int = 0, uid: str = "") -> Any:
    alloc = {"cpu": "64", "memory": "256Gi", "nvidia.com/gpu": str(whole)}
    if one_g:
        alloc["nvidia.com/mig-1g.10gb"] = str(one_g)
    if three_g:
        alloc["nvidia.com/mig-3g.40gb"] = str(three_g)
    labels = {P + "gpu.count": "2", P + "gpu.healthy": "2", P + "gpu.unhealthy": "0"}
    return {
        "metadata": {"name": name, "uid": uid or name, "labels": labels},
        "status": {"allocatable": alloc},
    }


def mig_pod(uid: str, node: str = "", **profiles: int) -> Any:
    req = {f"nvidia.com/mig-{p.replace('_', '.')}": str(n) for p, n in profiles.items()}
    return {
        "metadata": {"uid": uid, "name": uid, "namespace": "default"},
        "spec": {"nodeName": node, "containers": [{"name": "c", "resources": {"limits": req}}]},
        "status": {"phase": "Running"},
    }


def test_the_pod_shape_reads_mig_requests_and_limits() -> None:
    s = pod_shape(mig_pod("p", **{"1g_10gb": 2, "3g_40gb": 1}), P + "gpu.product")
    assert (s.gpus, s.mig, s.wants_gpus) == (0, (("1g.10gb", 2), ("3g.40gb", 1)), True)
    plain = {"spec": {"containers": [{"name": "c", "resources": {"requests": {"cpu": "1"}}}]}}
    assert not pod_shape(plain, P + "gpu.product").wants_gpus


def test_free_devices_per_profile_from_allocatable_bound_and_assumed_pods() -> None:
    clock = FakeClock()
    c = ClusterState(P, clock=clock, assume_ttl_s=30)
    c.replace_nodes([mig_node("a")])
    c.replace_pods([mig_pod("p1", "a", **{"1g_10gb": 3}), mig_pod("p2", "a", **{"3g_40gb": 1})])
    a = c.states(["a"])["a"]
    assert a is not None and a.mig_free == {"1g.10gb": 4, "3g.40gb": 1}
    c.assume("p3", "a", PodShape(0, mig=(("1g.10gb", 4),)))
    a = c.states(["a"])["a"]
    assert a is not None and a.mig_free == {"1g.10gb": 0, "3g.40gb": 1}
    one = PodShape(0, mig=(("1g.10gb", 1),))
    assert not a.can_host(one)  # the ranking counts the assumption...
    assert check_node(a, one, fresh=True) is None  # ...the filter leaves it to the scheduler
    c.pod_event("ADDED", mig_pod("p4", "a", **{"1g_10gb": 4}))  # bound: the filter counts it
    a = c.states(["a"])["a"]
    why = check_node(a, one, fresh=True)
    assert why is not None and why.reason == "insufficient_mig"
    assert why.message == "pod needs 1 nvidia.com/mig-1g.10gb, 0 free (7 allocatable, 7 requested)"
    c.pod_event("DELETED", mig_pod("p4", "a"))
    c.pod_event("DELETED", mig_pod("p1", "a"))
    clock.t += 31  # the assumption lapses
    a = c.states(["a"])["a"]
    assert a is not None and a.mig_free == {"1g.10gb": 7, "3g.40gb": 1}


def test_an_unknown_profile_fits_nowhere() -> None:
    a = NodeState("a", mig_allocatable=(("1g.10gb", 7),))
    assert not a.can_host(PodShape(0, mig=(("2g.20gb", 1),)))


def test_single_strategy_health_reads_the_unhealthy_label_not_count_minus_healthy() -> None:
    node = mig_node("s", one_g=0, three_g=0, whole=14)
    node["metadata"]["labels"].update({P + "gpu.count": "14", P + "gpu.healthy": "2"})
    c = ClusterState(P)
    c.replace_nodes([node])
    s = c.states(["s"])["s"]
    assert s is not None and s.gpus_unhealthy == 0 and s.gpus_free == 14


@pytest.mark.parametrize("weight", [0.0, 0.5])
def test_migpack_fills_the_partly_used_node_and_keeps_whole_gpus_whole(weight: float) -> None:
    pod = PodShape(0, mig=(("1g.10gb", 1),))
    fresh = NodeState("fresh", mig_allocatable=(("1g.10gb", 7), ("3g.40gb", 2)))
    partly = NodeState(
        "partly", mig_allocatable=(("1g.10gb", 7), ("3g.40gb", 2)), mig_requested=(("1g.10gb", 3),)
    )
    whole = NodeState("whole", gpus_allocatable=1, mig_allocatable=(("1g.10gb", 7),))
    policy = MigPack(weight)
    scores = {n.name: policy.raw_score(n, pod) for n in (fresh, partly, whole)}
    assert max(scores, key=scores.__getitem__) == "partly"
    assert min(scores, key=scores.__getitem__) == "whole"


def test_the_scheduler_config_names_every_mig_profile_we_know() -> None:
    """kube-scheduler has no wildcard for managedResources: a profile missing from the
    chart's list would send its pods past the extender."""
    import yaml

    from gpudaemon.backends import migprofiles
    from gpudaemon.labels.mig import resource_suffix
    from tests.support import REPO

    values = yaml.safe_load((REPO / "deploy/helm/gpudaemon/values.yaml").read_text())
    managed = {r["name"] for r in values["scheduler"]["managedResources"]}
    models = [("A100", 40960), ("A100", 81920), ("H100", 81559), ("H200", 143771)]
    for name, mib in models:
        table = migprofiles.profiles_for(name, mib)
        assert table is not None
        for profile in table:
            assert "nvidia.com/" + resource_suffix(profile) in managed, (name, profile)
