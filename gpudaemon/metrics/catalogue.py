"""The metric catalogue, as data: one row per per-GPU reading.

The Prometheus collector and the InfluxDB writer both iterate this table, so a
reading cannot be exported one way and forgotten the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

PREFIX = "gpudaemon_"


@dataclass(frozen=True)
class GpuMetric:
    name: str  # Prometheus name without the prefix; counters end in _total
    kind: Literal["gauge", "counter"]
    help: str
    field: str  # attribute of model.GpuSample

    @property
    def influx_field(self) -> str:
        """InfluxDB field name: the metric name without its 'gpu_' head."""
        return self.name.removeprefix("gpu_")


GPU_METRICS: tuple[GpuMetric, ...] = (
    GpuMetric(
        "gpu_utilization_ratio",
        "gauge",
        "Fraction of time a kernel was running on the GPU (0-1).",
        "gpu_utilization_ratio",
    ),
    GpuMetric(
        "gpu_memory_utilization_ratio",
        "gauge",
        "Fraction of time device memory was being read or written (0-1).",
        "memory_utilization_ratio",
    ),
    GpuMetric("gpu_memory_used_bytes", "gauge", "Device memory in use.", "memory_used_bytes"),
    GpuMetric("gpu_memory_free_bytes", "gauge", "Device memory free.", "memory_free_bytes"),
    GpuMetric("gpu_memory_total_bytes", "gauge", "Device memory in total.", "memory_total_bytes"),
    GpuMetric("gpu_temperature_celsius", "gauge", "GPU core temperature.", "temperature_celsius"),
    GpuMetric("gpu_power_watts", "gauge", "Power draw of the board.", "power_watts"),
    GpuMetric(
        "gpu_energy_joules_total",
        "counter",
        "Energy used since the driver was loaded.",
        "energy_joules_total",
    ),
    GpuMetric("gpu_sm_clock_hertz", "gauge", "Streaming-multiprocessor clock.", "sm_clock_hertz"),
    GpuMetric("gpu_memory_clock_hertz", "gauge", "Memory clock.", "memory_clock_hertz"),
    GpuMetric("gpu_processes", "gauge", "Compute processes running on the GPU.", "process_count"),
)

# Readings with an extra label dimension; exported by name from these fields.
ECC_ERRORS = GpuMetric(
    "gpu_ecc_errors_total",
    "counter",
    "ECC errors since the driver was loaded, by type (corrected, uncorrected).",
    "ecc_corrected_errors_total",
)
XID_ERRORS = GpuMetric(
    "gpu_xid_errors_total",
    "counter",
    "XID errors reported by the driver, by XID code.",
    "xid_errors_total",
)
HEALTHY = GpuMetric("gpu_healthy", "gauge", "1 when the GPU is healthy, 0 when not.", "healthy")
LOST = GpuMetric(
    "gpu_lost",
    "gauge",
    "1 when the driver reports the GPU as lost (fell off the bus), 0 when not.",
    "lost",
)
