"""One control plane for the DRA tests: kube-apiserver (resource.k8s.io/v1 served by
default in 1.37), kube-controller-manager with the resourceclaim controller (claims
from ResourceClaimTemplates), ReplicaSets and PDBs, the extender with `dra` on, and
gpudaemon-scheduler (its DynamicResources plug-in allocates the claims) plus a plain
default scheduler. No kubelet and no NVIDIA driver: live agents on simulated GPUs, the
rebalancer rig's kubelet stand-in (it marks bound pods Running), and `publish_slice`
writing each node's ResourceSlice as NVIDIA's driver does."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.integration.rebalancer.rig import RebalanceRig, running_rig
from tests.integration.scheduler.rig import SCHED_CONFIG

CONTROLLERS = (
    "resourceclaim-controller,replicaset-controller,deployment-controller,"
    "disruption-controller,garbage-collector-controller"
)


def dra_scheduler_config() -> dict[str, object]:
    """The shipped profile as the chart renders it with dra.enabled: no managedResources
    (kube-scheduler sends an extender only pods whose containers request one of them).
    The shipped example has none either (issue 40); the DRA rig stays without them
    should the example list them again."""
    conf = yaml.safe_load(SCHED_CONFIG.read_text())
    conf["extenders"][0].pop("managedResources", None)
    return conf  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def rig(tools_bin: Path) -> Iterator[RebalanceRig]:
    with running_rig(tools_bin, CONTROLLERS, dra=True, sched_conf=dra_scheduler_config(),
                     default_scheduler=True) as r:  # fmt: skip
        yield r
