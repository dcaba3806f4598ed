"""One control plane, extender and pair of kube-schedulers for the scheduler tests
(separate from tests/integration/kube, whose GPU nodes would otherwise be candidates)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.kube.controlplane import ADMISSION, RBAC, ControlPlane
from tests.integration.scheduler.rig import SchedulerRig


@pytest.fixture(scope="module")
def rig(tools_bin: Path) -> Iterator[SchedulerRig]:
    cp = ControlPlane(tools_bin)
    r = SchedulerRig(cp)
    try:
        cp.start()
        cp.apply_manifest(RBAC)
        cp.apply_manifest(ADMISSION)
        r.start_extender(policy="binpack")  # the tests predict bin-packing
        r.start_scheduler("gpudaemon-scheduler", with_extender=True)
        r.start_scheduler("default-scheduler", with_extender=False)
        yield r
    finally:
        r.stop()
        cp.stop()
