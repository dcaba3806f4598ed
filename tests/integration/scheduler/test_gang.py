"""Gang jobs with the real scheduler-plugins kube-scheduler (issue 21): Coscheduling and
our extender in one `gpudaemon-scheduler` profile, configured exactly as the chart
renders it with `scheduler.gang.enabled=true`, on a real API server with the PodGroup
CRD from the same scheduler-plugins release (both built by scripts/test-tools).

1. All or nothing: with 20 GPUs free on four 8-GPU nodes, a 3 x 8 gang gets no pod
   bound while a 2 x 8 gang created with it is bound in full.
2. No deadlock: of two gangs that cannot both fit, created together, one is bound in
   full and the other has no pod bound, also after its timeout.
3. Packed: a 3 x 2 gang lands on one node, the partly used one that fits it all, as
   bin-packing the gang as a unit predicts."""

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
from tests.support import REPO, wait_for

pytestmark = pytest.mark.integration

GANG_LABEL = "scheduling.x-k8s.io/pod-group"
TIMEOUT_S = 8  # each PodGroup's scheduleTimeoutSeconds: how long members wait at Permit


def chart_gang_config(helm: Path) -> dict[str, Any]:
    proc = subprocess.run(
        [str(helm), "template", "gpudaemon", str(REPO / "deploy/helm/gpudaemon"), "-n", "gpudaemon",
         "--set", "scheduler.gang.enabled=true", "--set", "scheduler.gang.permitWaitingTimeSeconds=8",
         "--set", "image.repository=registry.example.com/gpudaemon",
         "--show-only", "templates/scheduler/configmap.yaml"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return dict(yaml.safe_load(yaml.safe_load(proc.stdout)["data"]["config.yaml"]))


@pytest.fixture(scope="module")
def rig(tools_bin: Path) -> Iterator[SchedulerRig]:
    cp = ControlPlane(tools_bin)
    r = SchedulerRig(cp)
    try:
        cp.start()
        cp.apply_manifest(RBAC)
        cp.apply_manifest(ADMISSION)
        crd = yaml.safe_load((tools_bin / "scheduling.x-k8s.io_podgroups.yaml").read_text())
        cp.admin.request(
            "POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", body=crd
        )
        wait_for(
            lambda: (
                "podgroups"
                in {
                    x["name"]
                    for x in cp.admin.request("GET", "/apis/scheduling.x-k8s.io/v1alpha1")[
                        "resources"
                    ]
                }
            ),
            timeout=30,
            what="the PodGroup API served",
        )
        r.start_extender(policy="binpack")
        conf = chart_gang_config(tools_bin / "helm")
        assert conf["profiles"][0]["plugins"]["multiPoint"]["enabled"] == [{"name": "Coscheduling"}]
        r.start_scheduler("gpudaemon-scheduler", with_extender=True, conf=conf,
                          binary="kube-scheduler-plugins")  # fmt: skip
        yield r
    finally:
        r.stop()
        cp.stop()


def nodes_with_used(rig: SchedulerRig, used: list[int]) -> tuple[str, list[str]]:
    """Four 8-GPU nodes run by real agents, with `used` GPUs taken by bound pods."""
    group = uuid.uuid4().hex[:6]
    nodes = [f"{group}-n{i}" for i in range(len(used))]
    for n in nodes:
        rig.add_node(n, group)
    rig.run_agents(nodes)
    rig.wait_extender_sees(nodes)
    for n, u in zip(nodes, used, strict=True):
        if u:
            rig.create_pod(u, group, node=n)
    ext = rig.extender
    assert ext is not None
    wait_for(
        lambda: (
            [s.gpus_free for s in ext.cluster.states(nodes).values() if s] == [8 - u for u in used]
        ),
        timeout=15,
        what="the bound pods in the extender's cache",
    )
    return group, nodes


def gang(rig: SchedulerRig, group: str, pods: int, gpus: int, min_member: int) -> list[str]:
    name = f"pg-{uuid.uuid4().hex[:6]}"
    rig.cp.admin.request(
        "POST", f"/apis/scheduling.x-k8s.io/v1alpha1/namespaces/{NS}/podgroups",
        body={"apiVersion": "scheduling.x-k8s.io/v1alpha1", "kind": "PodGroup",
              "metadata": {"name": name},
              "spec": {"minMember": min_member, "scheduleTimeoutSeconds": TIMEOUT_S}},
    )  # fmt: skip
    return [rig.create_pod(gpus, group, labels={GANG_LABEL: name}) for _ in range(pods)]


def bound(rig: SchedulerRig, names: list[str]) -> dict[str, str]:
    out = {}
    for n in names:
        node = rig.pod(n)["spec"].get("nodeName")
        if node:
            out[n] = node
    return out


def test_all_or_nothing(rig: SchedulerRig) -> None:
    group, nodes = nodes_with_used(rig, [0, 0, 4, 8])  # 8 + 8 + 4 + 0 = 20 free
    three = gang(rig, group, 3, 8, 3)
    two = gang(rig, group, 2, 8, 2)
    wait_for(lambda: len(bound(rig, two)) == 2, timeout=60, what="the 2 x 8 gang bound in full")
    assert sorted(bound(rig, two).values()) == nodes[:2]
    time.sleep(TIMEOUT_S + 4)  # past the 3 x 8 gang's timeout, and its retries
    assert bound(rig, three) == {}, "a 3 x 8 gang cannot fit in 20 GPUs: no pod of it binds"


def test_two_gangs_that_cannot_both_fit_do_not_deadlock(rig: SchedulerRig) -> None:
    group, nodes = nodes_with_used(rig, [0, 0, 0, 0])  # 32 free: 24 + 16 do not fit
    a = gang(rig, group, 3, 8, 3)
    b = gang(rig, group, 2, 8, 2)

    def one_complete() -> bool:
        return len(bound(rig, a)) == 3 or len(bound(rig, b)) == 2

    wait_for(one_complete, timeout=90, what="one of the two gangs bound in full")
    time.sleep(TIMEOUT_S + 4)  # the other's members time out at Permit and retry
    done_a, done_b = bound(rig, a), bound(rig, b)
    assert (len(done_a), len(done_b)) in ((3, 0), (0, 2)), (done_a, done_b)
    # Nothing of the losing gang holds a GPU: the GPUs the winner left are free, as the
    # API says, and the extender's filter counts them free too.
    ext = rig.extender
    assert ext is not None
    used = rig.gpus_by_node(nodes)
    states = ext.cluster.states(nodes)
    assert {n: 8 - used[n] for n in nodes} == {n: s.gpus_free_bound for n, s in states.items() if s}


def test_a_gang_is_packed_onto_the_fewest_nodes_preferring_partly_used_ones(
    rig: SchedulerRig,
) -> None:
    # free 6, 8, 4, 2: the 3 x 2 gang fits whole on n0 (partly used) or n1 (empty);
    # bin-packing the gang as a unit picks n0. Pod by pod it would go to n3, then n2.
    group, nodes = nodes_with_used(rig, [2, 0, 4, 6])
    members = gang(rig, group, 3, 2, 3)
    wait_for(lambda: len(bound(rig, members)) == 3, timeout=60, what="the gang bound")
    assert set(bound(rig, members).values()) == {nodes[0]}
