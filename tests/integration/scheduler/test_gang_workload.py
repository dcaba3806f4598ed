"""Gang jobs with Kubernetes' own gang scheduling (issue 31): the stock 1.37
kube-scheduler's GangScheduling plug-in and our extender in one `gpudaemon-scheduler`
profile, configured exactly as the chart renders it with `scheduler.gang.mode=workload`
(its KubeSchedulerConfiguration and its --feature-gates), on a real 1.37 API server
serving the Workload API (scheduling.k8s.io/v1beta1: Workload and PodGroup). No
scheduler-plugins binary, no CRD.

1. All or nothing: with 20 GPUs free on four 8-GPU nodes, a Workload of 3 x 8 (min 3)
   gets no pod bound while one of 2 x 8 (min 2) created with it is bound in full.
2. No deadlock: of two gangs that cannot both fit, created together, one is bound in
   full and the other holds nothing, as the API and the extender both count.
3. Packed: a 4 x 2 gang with no node free enough for all of it lands on two nodes,
   the partly used ones it fills exactly, as bin-packing the gang as a unit predicts."""

from __future__ import annotations

import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.kube.controlplane import ADMISSION, RBAC, ControlPlane
from tests.integration.scheduler.rig import NS, SchedulerRig
from tests.integration.scheduler.test_gang import bound, nodes_with_used
from tests.support import REPO, wait_for

pytestmark = pytest.mark.integration

API = "/apis/scheduling.k8s.io/v1beta1"
# The Workload API is beta in 1.37 and, as beta APIs are, off by default: the cluster's
# kube-apiserver needs the gate and the group version (docs/install.md).
APISERVER_ARGS = ("--feature-gates=GenericWorkload=true",
                  "--runtime-config=scheduling.k8s.io/v1beta1=true")  # fmt: skip
SETTLE_S = 12  # long enough for a gang that cannot fit to have been tried and retried


def chart_rendered(helm: Path) -> tuple[dict[str, Any], list[str]]:
    """The chart's scheduler config and kube-scheduler flags for mode workload."""
    docs = {}
    for show in ("configmap", "deployment"):
        proc = subprocess.run(
            [str(helm), "template", "gpudaemon", str(REPO / "deploy/helm/gpudaemon"),
             "-n", "gpudaemon", "--set", "scheduler.gang.mode=workload",
             "--set", "image.repository=registry.example.com/gpudaemon",
             "--show-only", f"templates/scheduler/{show}.yaml"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        docs[show] = yaml.safe_load(proc.stdout)
    conf = dict(yaml.safe_load(docs["configmap"]["data"]["config.yaml"]))
    containers = docs["deployment"]["spec"]["template"]["spec"]["containers"]
    sched = next(c for c in containers if c["name"] == "kube-scheduler")
    assert "scheduler-plugins" not in sched["image"]
    flags = [a for a in sched["command"][1:] if a.startswith("--feature-gates=")]
    return conf, flags


@pytest.fixture(scope="module")
def rig(tools_bin: Path) -> Iterator[SchedulerRig]:
    cp = ControlPlane(tools_bin, apiserver_args=APISERVER_ARGS)
    r = SchedulerRig(cp)
    try:
        cp.start()
        cp.apply_manifest(RBAC)
        cp.apply_manifest(ADMISSION)
        served = {x["name"] for x in cp.admin.request("GET", API)["resources"]}
        assert {"workloads", "podgroups"} <= served, served
        r.start_extender(policy="binpack")
        conf, flags = chart_rendered(tools_bin / "helm")
        enabled = conf["profiles"][0]["plugins"]["multiPoint"]["enabled"]
        assert enabled == [{"name": "GangScheduling"}], enabled
        assert flags == ["--feature-gates=GenericWorkload=true"], flags
        r.start_scheduler("gpudaemon-scheduler", with_extender=True, conf=conf, args=flags)
        yield r
    finally:
        r.stop()
        cp.stop()


def gang(rig: SchedulerRig, group: str, pods: int, gpus: int, min_count: int) -> list[str]:
    """A Workload with one gang PodGroup template, its PodGroup, and `pods` pods that
    name the PodGroup in spec.schedulingGroup (what the Job controller does with
    WorkloadWithJob; done by hand here, as a user without it would)."""
    name = f"wl-{uuid.uuid4().hex[:6]}"
    policy = {"gang": {"minCount": min_count}}
    rig.cp.admin.request(
        "POST", f"{API}/namespaces/{NS}/workloads",
        body={"apiVersion": "scheduling.k8s.io/v1beta1", "kind": "Workload",
              "metadata": {"name": name},
              "spec": {"podGroupTemplates": [{"name": "workers", "schedulingPolicy": policy}]}},
    )  # fmt: skip
    pg = f"{name}-workers"
    rig.cp.admin.request(
        "POST", f"{API}/namespaces/{NS}/podgroups",
        body={"apiVersion": "scheduling.k8s.io/v1beta1", "kind": "PodGroup",
              "metadata": {"name": pg},
              "spec": {"workloadRef": {"workloadName": name, "templateName": "workers"},
                       "schedulingPolicy": policy}},
    )  # fmt: skip
    ref = {"schedulingGroup": {"podGroupName": pg}}
    return [rig.create_pod(gpus, group, spec_extra=ref) for _ in range(pods)]


def test_all_or_nothing(rig: SchedulerRig) -> None:
    group, nodes = nodes_with_used(rig, [0, 0, 4, 8])  # 8 + 8 + 4 + 0 = 20 free
    three = gang(rig, group, 3, 8, 3)
    two = gang(rig, group, 2, 8, 2)
    wait_for(lambda: len(bound(rig, two)) == 2, timeout=60, what="the 2 x 8 gang bound in full")
    assert sorted(bound(rig, two).values()) == nodes[:2]
    time.sleep(SETTLE_S)  # the 3 x 8 gang is tried again as pods and nodes change
    assert bound(rig, three) == {}, "a 3 x 8 gang cannot fit in 20 GPUs: no pod of it binds"


def test_two_gangs_that_cannot_both_fit_do_not_deadlock(rig: SchedulerRig) -> None:
    group, nodes = nodes_with_used(rig, [0, 0, 0, 0])  # 32 free: 24 + 16 do not fit
    a = gang(rig, group, 3, 8, 3)
    b = gang(rig, group, 2, 8, 2)

    def one_complete() -> bool:
        return len(bound(rig, a)) == 3 or len(bound(rig, b)) == 2

    wait_for(one_complete, timeout=90, what="one of the two gangs bound in full")
    time.sleep(SETTLE_S)  # a negative check: the other gang's retries bind nothing
    done_a, done_b = bound(rig, a), bound(rig, b)
    assert (len(done_a), len(done_b)) in ((3, 0), (0, 2)), (done_a, done_b)
    # Nothing of the losing gang holds a GPU: the GPUs the winner left are free, as the
    # API says, and the extender's filter counts them free too (bound pods; a loser's
    # member ranked in a failed group cycle is only an assumption, which changes a
    # ranking but never blocks a node, and which the loser's retries renew).
    ext = rig.extender
    assert ext is not None
    used = rig.gpus_by_node(nodes)
    states = ext.cluster.states(nodes)
    assert {n: 8 - used[n] for n in nodes} == {n: s.gpus_free_bound for n, s in states.items() if s}


def test_a_gang_is_packed_onto_the_fewest_nodes_preferring_partly_used_ones(
    rig: SchedulerRig,
) -> None:
    # free 6, 2, 4, 4: no node takes all 8 GPUs of a 4 x 2 gang, so it needs two. The
    # extender's gang tiers start it on the tightest node (n1, 2 free) and send the
    # rest where the whole rest fits (n0, 6 free): both end full, n2 and n3 untouched.
    group, nodes = nodes_with_used(rig, [2, 6, 4, 4])
    members = gang(rig, group, 4, 2, 4)
    wait_for(lambda: len(bound(rig, members)) == 4, timeout=60, what="the gang bound")
    placed = bound(rig, members)
    assert set(placed.values()) == {nodes[0], nodes[1]}, placed
