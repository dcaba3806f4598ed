"""The catalogue of per-GPU series, as data: one row per series.

Every per-GPU (and per-MIG-instance) series the agent exports is a row here: plain
readings, health, lost, ECC by type, XID by code, the info series and the MIG series.
The Prometheus collector (agent/metrics/collector.py) and the InfluxDB line encoder
(history/lines.py) both iterate only this table, so a series cannot be exported one
way and forgotten the other; tests/unit/test_catalogue.py fails if they drift.

A row says how to read its values, its Prometheus type and extra label, and its
InfluxDB field: the name (`{}` stands for the extra label's value) and the type
(int fields are written with the `i` suffix, so InfluxDB never sees a type change).
"""

from __future__ import annotations

from typing import Literal

from gpudaemon.catalogue.series import (
    GPU_LABELS,
    GPU_MEASUREMENT,
    INFO_LABELS,
    MIG_LABELS,
    MIG_MEASUREMENT,
    PREFIX,
    GpuValues,
    InfoLabels,
    MigValue,
    Number,
    Series,
    _gauge,
    _reading,
)
from gpudaemon.catalogue.values import (
    _GPM_NOTE,
    _GPM_RATIOS,
    _clock_active,
    _clock_seconds,
    _ecc,
    _flag,
    _gpm,
    _gpm_bytes,
    _health_action,
    _health_state,
    _info,
    _mig_gpm,
    _mig_total,
    _mig_used,
    _nvlink,
    _recovery,
    _remapped,
    _retired,
    _xid,
)
from gpudaemon.model import GpuSample, MigDevice, MigSample

__all__ = [
    "CATALOGUE",
    "GPU_LABELS",
    "GPU_MEASUREMENT",
    "INFO_LABELS",
    "MIG_LABELS",
    "MIG_MEASUREMENT",
    "PREFIX",
    "GpuValues",
    "InfoLabels",
    "MigValue",
    "Number",
    "Series",
    "influx_fields",
    "mig_influx_fields",
    "rows",
]

CATALOGUE: tuple[Series, ...] = (
    Series(
        "gpu_info",
        "gauge",
        "GPU facts as labels; always 1.",
        "info",
        info=_info,
        influx_note="facts, not readings: InfluxDB points carry the model as a tag",
    ),
    _gauge(
        "gpu_utilization_ratio",
        "Fraction of time a kernel was running on the GPU (0-1).",
        "gpu_utilization_ratio",
    ),
    _gauge(
        "gpu_memory_utilization_ratio",
        "Fraction of time device memory was being read or written (0-1).",
        "memory_utilization_ratio",
    ),
    _gauge("gpu_memory_used_bytes", "Device memory in use.", "memory_used_bytes", int),
    _gauge("gpu_memory_free_bytes", "Device memory free.", "memory_free_bytes", int),
    _gauge("gpu_memory_total_bytes", "Device memory in total.", "memory_total_bytes", int),
    _gauge("gpu_temperature_celsius", "GPU core temperature.", "temperature_celsius"),
    _gauge("gpu_power_watts", "Power draw of the board.", "power_watts"),
    Series(
        "gpu_energy_joules_total",
        "counter",
        "Energy used since the driver was loaded (read on schedules.energy, default 30 s).",
        "gpu",
        gpu=_reading("energy_joules_total"),
        influx_field="energy_joules_total",
    ),
    _gauge("gpu_sm_clock_hertz", "Streaming-multiprocessor clock.", "sm_clock_hertz"),
    _gauge("gpu_memory_clock_hertz", "Memory clock.", "memory_clock_hertz"),
    _gauge("gpu_processes", "Compute processes running on the GPU.", "process_count", int),
    Series(
        "gpu_healthy",
        "gauge",
        "1 when the GPU is healthy, 0 when not.",
        "gpu",
        gpu=lambda s: (("", 1 if s.healthy else 0),),
        influx_field="healthy",
        influx_type=int,
    ),
    Series(
        "gpu_lost",
        "gauge",
        "1 when the driver reports the GPU as lost (fell off the bus), 0 when not.",
        "gpu",
        gpu=lambda s: (("", 1 if s.lost else 0),),
        influx_field="lost",
        influx_type=int,
    ),
    Series(
        "gpu_ecc_errors_total",
        "counter",
        "ECC errors since the driver was loaded, by type (corrected, uncorrected).",
        "gpu",
        label="type",
        gpu=_ecc,
        influx_field="ecc_{}_errors_total",
        influx_type=int,
    ),
    Series(
        "gpu_xid_errors_total",
        "counter",
        "XID errors reported by the driver, by XID code: the codes of our XID table "
        "(NVIDIA's catalog and the application set) by number, any other code summed "
        "under xid other, so the series stay bounded.",
        "gpu",
        label="xid",
        gpu=_xid,
        # All codes summed (per-code counts are in Prometheus); an empty map is a real
        # count, 0, not an unsupported reading.
        influx_field="xid_errors_total",
        influx_type=int,
        influx_sum=True,
    ),
    Series(
        "gpu_health_state",
        "gauge",
        "The GPU's health verdict: 1 for its state (healthy, degraded, unhealthy), 0 for "
        "the others (docs/operations.md, GPU health).",
        "gpu",
        label="state",
        gpu=_health_state,
        influx_field="health_state_{}",
        influx_type=int,
    ),
    Series(
        "gpu_health_action",
        "gauge",
        "The action the GPU's verdict asks for: 1 for it (none, watch, drain, reset_gpu, "
        "reboot_node, replace), 0 for the others.",
        "gpu",
        label="action",
        gpu=_health_action,
        influx_field="health_action_{}",
        influx_type=int,
    ),
    Series(
        "gpu_row_remap_pending",
        "gauge",
        "1 when a row remap is pending (takes effect on GPU reset), 0 when not; Ampere+.",
        "gpu",
        gpu=_flag("row_remap_pending"),
        influx_field="row_remap_pending",
        influx_type=int,
    ),
    Series(
        "gpu_row_remap_failed",
        "gauge",
        "1 when a row remap failed (no spare rows left: replace the GPU), 0 when not.",
        "gpu",
        gpu=_flag("row_remap_failed"),
        influx_field="row_remap_failed",
        influx_type=int,
    ),
    Series(
        "gpu_remapped_rows",
        "gauge",
        "Memory rows remapped so far, by the error that caused it (correctable, "
        "uncorrectable); Ampere+.",
        "gpu",
        label="cause",
        gpu=_remapped,
        influx_field="remapped_rows_{}",
        influx_type=int,
    ),
    Series(
        "gpu_retired_pages",
        "gauge",
        "Memory pages retired so far, by cause (single_bit, double_bit); before Ampere.",
        "gpu",
        label="cause",
        gpu=_retired,
        influx_field="retired_pages_{}",
        influx_type=int,
    ),
    Series(
        "gpu_retired_pages_pending",
        "gauge",
        "1 when a page retirement is pending (takes effect on driver reload), 0 when not.",
        "gpu",
        gpu=_flag("retired_pages_pending"),
        influx_field="retired_pages_pending",
        influx_type=int,
    ),
    Series(
        "gpu_recovery_action",
        "gauge",
        "The driver's recovery action for the GPU: 1 for the current one (none, "
        "gpu_reset, node_reboot, drain_p2p, drain_and_reset), 0 for the others.",
        "gpu",
        label="action",
        gpu=_recovery,
        influx_field="recovery_action_{}",
        influx_type=int,
    ),
    Series(
        "gpu_nvlink_errors_total",
        "counter",
        "NVLink errors since the driver was loaded, by link and type (crc_flit, "
        "crc_data, replay, recovery); read on schedules.health.",
        "gpu",
        label="link,type",
        gpu=_nvlink,
        # All links and types summed (per link and type in Prometheus).
        influx_field="nvlink_errors_total",
        influx_type=int,
        influx_sum=True,
    ),
    Series(
        "gpu_clock_event_active",
        "gauge",
        "1 while the clocks are slowed for the reason (hw_slowdown, hw_thermal, "
        "sw_thermal, hw_power_brake), 0 when not.",
        "gpu",
        label="reason",
        gpu=_clock_active,
        influx_field="clock_event_{}_active",
        influx_type=int,
    ),
    Series(
        "gpu_clock_event_seconds_total",
        "counter",
        "Time the clocks were slowed for the reason since the driver was loaded "
        "(hw_thermal, sw_thermal, hw_power_brake); read on schedules.health.",
        "gpu",
        label="reason",
        gpu=_clock_seconds,
        influx_field="clock_event_{}_seconds_total",
    ),
    *(
        Series(
            "gpu_" + name,
            "gauge",
            help_ + _GPM_NOTE,
            "gpu",
            gpu=_gpm(name),
            influx_field=name,
        )
        for name, help_ in _GPM_RATIOS
    ),
    Series(
        "gpu_nvlink_bytes_total",
        "counter",
        "Bytes over all NVLink links since the agent started reading, by direction (tx, "
        "rx): GPM's MiB/s integrated over each poll interval." + _GPM_NOTE,
        "gpu",
        label="direction",
        gpu=_gpm_bytes("nvlink_bytes_total"),
        influx_field="nvlink_{}_bytes_total",
        influx_type=int,
    ),
    Series(
        "gpu_pcie_bytes_total",
        "counter",
        "Bytes over PCIe since the agent started reading, by direction (tx, rx): GPM's "
        "MiB/s integrated over each poll interval." + _GPM_NOTE,
        "gpu",
        label="direction",
        gpu=_gpm_bytes("pcie_bytes_total"),
        influx_field="pcie_{}_bytes_total",
        influx_type=int,
    ),
    *(
        Series(
            "mig_" + name,
            "gauge",
            "Of the MIG device's GPU instance: " + help_ + _GPM_NOTE,
            "mig",
            mig=_mig_gpm(name),
            influx_field=name,
        )
        for name, help_ in _GPM_RATIOS
    ),
    Series(
        "mig_memory_used_bytes",
        "gauge",
        "Memory in use on a MIG instance.",
        "mig",
        mig=_mig_used,
        influx_field="memory_used_bytes",
        influx_type=int,
    ),
    Series(
        "mig_memory_total_bytes",
        "gauge",
        "Memory of a MIG instance.",
        "mig",
        mig=_mig_total,
        influx_field="memory_total_bytes",
        influx_type=int,
    ),
)


def rows(scope: Literal["gpu", "mig", "info"]) -> tuple[Series, ...]:
    return tuple(r for r in CATALOGUE if r.scope == scope)


def influx_fields(row: Series, sample: GpuSample) -> dict[str, Number]:
    """A GPU row's InfluxDB fields for one sample, typed as the row says."""
    if not row.influx_field or row.gpu is None:
        return {}
    values = list(row.gpu(sample))
    cast = row.influx_type
    if row.influx_sum:
        return {row.influx_field: cast(sum(v for _, v in values))}
    return {row.influx_field.format(*label.split(",")): cast(v) for label, v in values}


def mig_influx_fields(
    row: Series, device: MigDevice, sample: MigSample | None
) -> dict[str, Number]:
    """A MIG row's InfluxDB field for one instance; empty when the value is absent."""
    if not row.influx_field or row.mig is None:
        return {}
    v = row.mig(device, sample)
    return {} if v is None else {row.influx_field: row.influx_type(v)}
