"""GPM readings of the simulator fit its utilization for any pattern, load and timing:
SM activity never above utilization, tensor activity within SM activity, every ratio in
0..1, NVLink and PCIe byte counters never going down."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gpudaemon.backends.simulated import SimulatedBackend, parse_profile
from tests.clock import FakeClock

PROFILE = """
gpus:
  - name: NVIDIA H100 80GB HBM3
    memory_total_mib: 81559
    compute_capability: "9.0"
    nvlink_links: {links}
    utilization: {{pattern: {pattern}, noise: {noise}}}
"""


@settings(max_examples=60, deadline=None)
@given(
    pattern=st.sampled_from(["steady", "idle", "busy", "random-walk"]),
    noise=st.floats(min_value=0.0, max_value=1.0),
    links=st.integers(min_value=0, max_value=18),
    seed=st.integers(min_value=0, max_value=2**32),
    steps=st.lists(st.floats(min_value=0.0, max_value=120.0), min_size=2, max_size=25),
)
def test_gpm_fits_utilization(
    pattern: str, noise: float, links: int, seed: int, steps: list[float]
) -> None:
    clock = FakeClock(1000.0)
    p = parse_profile(PROFILE.format(pattern=pattern, noise=noise, links=links))
    b = SimulatedBackend(p, seed=seed, clock=clock)
    last: dict[tuple[str, str], int] = {}
    for dt in steps:
        clock.t += dt
        (s,) = b.sample()
        r = s.gpm
        if r is None:
            continue
        util = s.gpu_utilization_ratio
        assert util is not None and r.sm_active_ratio is not None
        assert r.tensor_active_ratio is not None
        assert 0.0 <= r.sm_active_ratio <= util <= 1.0
        assert 0.0 <= r.tensor_active_ratio <= r.sm_active_ratio
        for name in ("sm_occupancy_ratio", "dram_active_ratio", "fp64_active_ratio"):
            v = getattr(r, name)
            assert v is not None and 0.0 <= v <= 1.0
        for kind, counts in (("nvlink", r.nvlink_bytes_total), ("pcie", r.pcie_bytes_total)):
            for d, v in counts.items():
                assert v >= last.get((kind, d), 0)
                last[(kind, d)] = v
        assert bool(r.nvlink_bytes_total) == (links > 0)
