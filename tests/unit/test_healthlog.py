"""GPU faults from the simulated backend log one line when they start and one when they
end, however many polls they last (issue 12 item 14; docs/operations.md)."""

from __future__ import annotations

import pytest
from loguru import logger

from gpudaemon.agent.healthlog import HealthLog
from gpudaemon.backends.simulated import FaultSpec, SimulatedBackend, parse_profile
from gpudaemon.model import GpuSample
from tests.clock import FakeClock

PROFILE = "gpus: [{name: X, memory_total_mib: 1000, compute_capability: '9.0', count: 4}]"


def run(polls: int, fault: FaultSpec | None, gpu: int = 1) -> list[tuple[str, str]]:
    clock = FakeClock()
    backend = SimulatedBackend(parse_profile(PROFILE), seed=1, clock=clock)
    if fault is not None:
        backend.inject(gpu, fault)
    log = HealthLog(quiet_s=60, clock=clock)
    out: list[tuple[str, str]] = []
    sink = logger.add(lambda m: out.append((m.record["level"].name, m.record["message"])))
    try:
        for _ in range(polls):
            clock.advance(5)
            log.observe(backend.sample())
    finally:
        logger.remove(sink)
    return out


@pytest.mark.parametrize(
    ("fault", "reason"),
    [
        (FaultSpec(kind="lost"), "gpu lost"),
        (FaultSpec(kind="xid", xid=79), "xid 79"),
        (FaultSpec(kind="ecc", uncorrected=2), "ecc uncorrected errors"),
    ],
)
def test_a_fault_that_makes_the_gpu_unhealthy_is_one_error_line(
    fault: FaultSpec, reason: str
) -> None:
    out = run(50, fault)
    assert len(out) == 1, out
    level, message = out[0]
    assert level == "ERROR" and message.startswith("GPU 1 (GPU-") and message.endswith(reason)


def test_an_application_xid_burst_is_one_error_line_then_one_line_when_quiet() -> None:
    clock = FakeClock()
    backend = SimulatedBackend(parse_profile(PROFILE), seed=1, clock=clock)
    log = HealthLog(quiet_s=60, clock=clock)
    out: list[tuple[str, str]] = []
    sink = logger.add(lambda m: out.append((m.record["level"].name, m.record["message"])))
    try:
        for _ in range(6):  # an XID 13 every poll for 30 s
            backend.inject(2, FaultSpec(kind="xid", xid=13))
            clock.advance(5)
            log.observe(backend.sample())
        for _ in range(20):  # then 100 s of quiet
            clock.advance(5)
            log.observe(backend.sample())
    finally:
        logger.remove(sink)
    assert [lvl for lvl, _ in out] == ["ERROR", "INFO"], out
    assert "XID 13 (1 new; application error" in out[0][1]
    assert out[1][1] == "GPU 2: no new XID 13 for 60s (6 in that burst)"


def test_corrected_ecc_is_a_warning_per_burst() -> None:
    out = run(30, FaultSpec(kind="ecc", corrected=5))
    assert [lvl for lvl, _ in out] == ["WARNING", "INFO"], out
    assert "5 corrected ECC error(s)" in out[0][1]


def test_no_fault_no_lines() -> None:
    assert run(30, None) == []


def test_healthy_again_is_one_info_line(lines: list[tuple[str, str]]) -> None:
    log = HealthLog(clock=FakeClock())
    sick = GpuSample(index=0, uuid="GPU-a", healthy=False, health_reason="gpu lost")
    well = GpuSample(index=0, uuid="GPU-a")
    for s in [sick, sick, sick, well, well, sick, well]:
        log.observe([s])
    assert [lvl for lvl, _ in lines] == ["ERROR", "INFO", "ERROR", "INFO"], lines
    assert lines[1][1] == "GPU 0 (GPU-a) healthy again (was: gpu lost)"
