"""GPM in the simulator: Hopper profiles have it, an A100 has none, a profile can turn it
off, readings fit the utilization, counters are monotonic, the calls are charged."""

from __future__ import annotations

import pytest

from gpudaemon.backends.base import GPM_CALLS, GPM_MIG_CALLS, SAMPLE_CALLS
from gpudaemon.backends.simulated import SimulatedBackend, load_profile, parse_profile
from gpudaemon.errors import ProfileError
from tests.clock import FakeClock

H100 = """
gpus:
  - name: NVIDIA H100 80GB HBM3
    memory_total_mib: 81559
    compute_capability: "9.0"
    nvlink_links: 18
    {extra}
"""


def polls(b: SimulatedBackend, clock: FakeClock, n: int) -> list:
    out = []
    for _ in range(n):
        clock.t += 5
        out.append(b.sample())
    return out


def test_dgx_h100_has_gpm_after_the_first_poll() -> None:
    clock = FakeClock(1000.0)
    b = SimulatedBackend(load_profile("dgx-h100"), seed=1, clock=clock)
    first, second = polls(b, clock, 2)
    assert all(s.gpm is None for s in first)  # a pair needs two samples
    for s in second:
        assert s.gpm is not None and s.gpm.sm_active_ratio is not None
        assert set(s.gpm.nvlink_bytes_total) == {"tx", "rx"}
        assert set(s.gpm.pcie_bytes_total) == {"tx", "rx"}


@pytest.mark.parametrize("name", ["a100-mig", "mixed"])
def test_gpus_before_hopper_have_no_gpm(name: str) -> None:
    clock = FakeClock(1000.0)
    b = SimulatedBackend(load_profile(name), seed=1, clock=clock)
    for samples in polls(b, clock, 3):
        assert all(s.gpm is None and all(m.gpm is None for m in s.mig) for s in samples)


def test_a_profile_turns_gpm_off_per_gpu() -> None:
    clock = FakeClock(1000.0)
    p = parse_profile(H100.format(extra="gpm: false"))
    b = SimulatedBackend(p, clock=clock)
    assert all(s[0].gpm is None for s in polls(b, clock, 3))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            H100.replace('"9.0"', '"8.0"').format(extra="gpm: true"),
            "gpus.0: gpm: true needs compute_capability 9.0 or later (GPM is Hopper+), not 8.0",
        ),
        (H100.format(extra="gpm: 1"), "gpus.0.gpm: Input should be a valid boolean"),
    ],
)
def test_a_bad_gpm_field_is_one_line_at_load(text: str, message: str) -> None:
    with pytest.raises(ProfileError) as e:
        parse_profile(text)
    assert str(e.value) == f"profile inline: {message}"


def test_readings_fit_the_utilization_and_counters_only_grow() -> None:
    clock = FakeClock(1000.0)
    text = H100.format(extra="utilization: {pattern: sine, mean: 0.5, amplitude: 0.5}")
    b = SimulatedBackend(parse_profile(text), seed=3, clock=clock)
    last: dict[str, int] = {"tx": 0, "rx": 0}
    for (s,) in polls(b, clock, 200)[1:]:
        r = s.gpm
        assert r is not None and s.gpu_utilization_ratio is not None
        assert r.sm_active_ratio is not None and r.tensor_active_ratio is not None
        assert 0.0 <= r.sm_active_ratio <= s.gpu_utilization_ratio
        assert 0.0 <= r.tensor_active_ratio <= r.sm_active_ratio
        assert r.sm_occupancy_ratio is not None and r.sm_occupancy_ratio <= r.sm_active_ratio
        assert r.dram_active_ratio is not None and 0.0 <= r.dram_active_ratio <= 1.0
        for d, v in r.nvlink_bytes_total.items():
            assert v >= last[d]
            last[d] = v
    assert last["tx"] > 0


def test_mig_instances_on_an_h100_have_their_own_readings() -> None:
    clock = FakeClock(1000.0)
    text = H100.format(extra="mig: {enabled: true, instances: [3g.40gb, 2g.20gb, 1g.10gb]}")
    b = SimulatedBackend(parse_profile(text), clock=clock)
    (s,) = polls(b, clock, 2)[1]
    assert s.gpm is not None and s.gpm.sm_active_ratio is not None
    for m in s.mig:
        assert m.gpm is not None and m.gpm.sm_active_ratio is not None
        assert m.gpm.sm_active_ratio <= s.gpm.sm_active_ratio


def test_gpm_calls_are_charged_per_gpu_and_per_gpu_instance() -> None:
    latency = {c: 100.0 for c in {*SAMPLE_CALLS, *GPM_CALLS, *GPM_MIG_CALLS}}
    lat = "nvml_latency_us: {" + ", ".join(f"{k}: {v}" for k, v in latency.items()) + "}"
    plain = SimulatedBackend(parse_profile(H100.format(extra=lat)))._gpus[0]
    off = SimulatedBackend(parse_profile(H100.format(extra=f"gpm: false\n    {lat}")))._gpus[0]
    mig = SimulatedBackend(
        parse_profile(
            H100.format(extra=f"mig: {{enabled: true, instances: [1g.10gb, 1g.10gb]}}\n    {lat}")
        )
    )._gpus[0]
    base = len(SAMPLE_CALLS) * 100e-6
    assert off.cost_s() == pytest.approx(base)
    assert plain.cost_s() == pytest.approx(base + len(GPM_CALLS) * 100e-6)
    assert mig.cost_s() == pytest.approx(base + (len(GPM_CALLS) + 2 * len(GPM_MIG_CALLS)) * 100e-6)
