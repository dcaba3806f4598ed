"""One control plane with kube-controller-manager, the extender and gpudaemon-scheduler
for the rebalancer tests (issue 22)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.kube.controlplane import ADMISSION, RBAC, ControlPlane
from tests.integration.rebalancer.rig import RebalanceRig


@pytest.fixture(scope="module")
def rig(tools_bin: Path) -> Iterator[RebalanceRig]:
    cp = ControlPlane(tools_bin)
    r = RebalanceRig(cp)
    try:
        cp.start()
        cp.apply_manifest(RBAC)
        cp.apply_manifest(ADMISSION)
        r.start_controller_manager()
        r.start_extender(policy="binpack")
        r.start_scheduler("gpudaemon-scheduler", with_extender=True)
        r.kubelet.start()
        yield r
    finally:
        r.stop()
        cp.stop()
