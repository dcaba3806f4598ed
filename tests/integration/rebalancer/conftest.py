"""One control plane with kube-controller-manager, the extender and gpudaemon-scheduler
for the rebalancer tests (issue 22)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.rebalancer.rig import RebalanceRig, running_rig


@pytest.fixture(scope="module")
def rig(tools_bin: Path) -> Iterator[RebalanceRig]:
    with running_rig(tools_bin) as r:
        yield r
