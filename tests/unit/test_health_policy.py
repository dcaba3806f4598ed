"""The one health policy both backends use: lost, then first critical XID, then ECC."""

from __future__ import annotations

import pytest

from gpudaemon.backends.base import health_reason, lost_sample
from gpudaemon.backends.simulated import FaultSpec, SimulatedBackend, load_profile
from tests.clock import FakeClock


@pytest.mark.parametrize(
    "lost,xid,ecc,reason",
    [
        (False, None, None, ""),
        (False, None, 0, ""),
        (False, None, 2, "ecc uncorrected errors"),
        (False, 79, 2, "xid 79"),
        (True, 79, 2, "gpu lost"),
    ],
)
def test_precedence(lost: bool, xid: int | None, ecc: int | None, reason: str) -> None:
    assert health_reason(lost=lost, critical_xid=xid, ecc_uncorrected=ecc) == reason


def test_lost_sample_has_no_readings_and_keeps_xids() -> None:
    s = lost_sample(3, "GPU-x", {79: 1})
    assert (s.healthy, s.lost, s.health_reason) == (False, True, "gpu lost")
    assert s.xid_errors_total == {79: 1}
    assert s.gpu_utilization_ratio is None and s.memory_used_bytes is None


def test_simulated_backend_follows_the_policy_whatever_the_fault_order() -> None:
    b = SimulatedBackend(load_profile("dgx-h100"), clock=FakeClock(1000.0))
    b.inject(0, FaultSpec(kind="ecc", uncorrected=1))
    b.inject(0, FaultSpec(kind="xid", xid=79, after_polls=1))
    b.inject(0, FaultSpec(kind="xid", xid=48, after_polls=2))
    assert b.sample()[0].health_reason == "ecc uncorrected errors"
    assert b.sample()[0].health_reason == "xid 79"  # XID outranks ECC, as on NVML
    assert b.sample()[0].health_reason == "xid 79"  # the first critical XID sticks
