"""GPM (GPU Performance Monitoring, Hopper+) arithmetic shared by the NVML and simulated
backends: no NVML here, only the conversion of one pair of samples into a `GpmReading`.

GPM gives, for the interval between two samples, activity as percentages (0-100) and
NVLink / PCIe throughput as rates in MiB/s (nvidia-ml-py's NVML_GPM_METRIC_*_PER_SEC).
At this boundary percentages become ratios 0..1 (clamped: GPM's rounding can read
100.2), and each rate times the interval's length is added to a byte counter per
direction, so Prometheus gets a monotonic `_bytes_total` counter (its `rate()` gives the
throughput back, with any sampling interval). The counters start at 0 when the agent
starts reading the GPU; a restart is a counter reset, which `rate()` handles. An
interval whose pair could not be read (an error, the first poll) adds nothing: the
counter then undercounts that interval, it never invents bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from gpudaemon.model import MIB, GpmReading

# Our reading -> what it is made of. The tensor ratio is ANY_TENSOR (HMMA, IMMA, DMMA
# together: what DCGM_FI_PROF_PIPE_TENSOR_ACTIVE reports); DRAM is bandwidth utilization
# (DCGM_FI_PROF_DRAM_ACTIVE); fp64 is the non-tensor FP64 pipe (PIPE_FP64_ACTIVE).
RATIOS = (
    "sm_active_ratio",
    "sm_occupancy_ratio",
    "tensor_active_ratio",
    "dram_active_ratio",
    "fp64_active_ratio",
)
# (link kind, direction) rates in MiB/s, integrated into byte counters.
RATES = (("nvlink", "tx"), ("nvlink", "rx"), ("pcie", "tx"), ("pcie", "rx"))


def ratio(percent: float) -> float:
    """GPM's percentage as a ratio 0..1."""
    return min(1.0, max(0.0, float(percent) / 100.0))


@dataclass
class Counters:
    """One GPU's (or GPU instance's) byte counters, integrated from GPM rates."""

    bytes_total: dict[tuple[str, str], float] = field(default_factory=dict)

    def add(self, rates_mib_s: Mapping[tuple[str, str], float], seconds: float) -> None:
        for key, rate in rates_mib_s.items():
            if rate >= 0.0:  # a negative rate is not traffic; the counter exists from here
                added = rate * MIB * max(0.0, seconds)
                self.bytes_total[key] = self.bytes_total.get(key, 0.0) + added

    def of(self, kind: str) -> dict[str, int]:
        return {d: int(v) for (k, d), v in sorted(self.bytes_total.items()) if k == kind}


def reading(ratios: Mapping[str, float], counters: Counters) -> GpmReading:
    """One GpmReading from this pair's ratios (absent ones stay None) and the counters."""
    return GpmReading(
        **{name: ratios[name] for name in RATIOS if name in ratios},
        nvlink_bytes_total=counters.of("nvlink"),
        pcie_bytes_total=counters.of("pcie"),
    )
