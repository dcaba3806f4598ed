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

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

from gpudaemon.health.signals import CLOCK_EVENT_REASONS, RECOVERY_ACTION_NAMES
from gpudaemon.health.verdict import ACTIONS, STATES
from gpudaemon.model import GpuInfo, GpuSample, MigDevice, MigSample, NodeInventory

PREFIX = "gpudaemon_"
Number = int | float
# A GPU row's values: (extra label value, value) pairs; "" when the row has no label.
GpuValues = Callable[[GpuSample], Iterable[tuple[str, Number]]]
# A MIG row's value for one instance (its inventory entry, its newest reading).
MigValue = Callable[[MigDevice, MigSample | None], Number | None]
# The info row's label values for one GPU.
InfoLabels = Callable[[NodeInventory, GpuInfo], tuple[str, ...]]

# Labels every per-GPU series carries. Unattributed series carry pod="" etc., which
# Prometheus stores as "label absent". InfluxDB tags: node, gpu, uuid, model.
GPU_LABELS = ("gpu", "uuid", "model", "node", "pod", "namespace", "container")
MIG_LABELS = (*GPU_LABELS, "mig_uuid", "mig_profile", "gpu_instance_id")
INFO_LABELS = ("driver_version", "cuda_version", "pci_bus_id", "compute_capability", "mig_mode")
# InfluxDB measurements: one point per GPU, one per MIG instance.
GPU_MEASUREMENT = "gpu"
MIG_MEASUREMENT = "mig"


@dataclass(frozen=True)
class Series:
    """One row. `name` is the Prometheus name without the prefix; counters end in
    `_total`. `scope` says what one sample of it describes: a GPU, a MIG instance, or
    (info) a GPU's facts as labels."""

    name: str
    kind: Literal["gauge", "counter"]
    help: str
    scope: Literal["gpu", "mig", "info"]
    # Prometheus: an extra label (ECC "type", XID "xid"); info: its label names.
    label: str = ""
    # InfluxDB: field name ("" = not in InfluxDB, see `influx_note`); `{}` is
    # replaced by the extra label's value; `influx_sum` adds the labelled values
    # into one field instead.
    influx_field: str = ""
    influx_type: type[int] | type[float] = float
    influx_sum: bool = False
    influx_note: str = ""
    gpu: GpuValues | None = None
    mig: MigValue | None = None
    info: InfoLabels | None = None

    @property
    def prometheus_name(self) -> str:
        return PREFIX + self.name

    @property
    def labels(self) -> tuple[str, ...]:
        if self.scope == "mig":
            return MIG_LABELS
        if self.scope == "info":
            return (*GPU_LABELS, *INFO_LABELS)
        # A row may carry two extra labels ("link,type"): its values then name both,
        # comma-separated in the same order.
        return (*GPU_LABELS, *self.label.split(",")) if self.label else GPU_LABELS


def _reading(attr: str) -> GpuValues:
    """A plain reading: the sample's attribute, absent when None."""

    def read(s: GpuSample) -> Iterable[tuple[str, Number]]:
        v = getattr(s, attr)
        return () if v is None else (("", v),)

    return read


def _gauge(name: str, help_: str, attr: str, kind: type[int] | type[float] = float) -> Series:
    return Series(
        name,
        "gauge",
        help_,
        "gpu",
        gpu=_reading(attr),
        influx_field=name.removeprefix("gpu_"),
        influx_type=kind,
    )


def _ecc(s: GpuSample) -> Iterable[tuple[str, Number]]:
    if s.ecc_corrected_errors_total is not None:
        yield "corrected", s.ecc_corrected_errors_total
    if s.ecc_uncorrected_errors_total is not None:
        yield "uncorrected", s.ecc_uncorrected_errors_total


def _xid(s: GpuSample) -> Iterable[tuple[str, Number]]:
    return [(str(code), n) for code, n in sorted(s.xid_errors_total.items())]


def _flag(attr: str) -> GpuValues:
    """A 0/1 reading from a bool; absent when None."""

    def read(s: GpuSample) -> Iterable[tuple[str, Number]]:
        v = getattr(s, attr)
        return () if v is None else (("", 1 if v else 0),)

    return read


def _remapped(s: GpuSample) -> Iterable[tuple[str, Number]]:
    if s.remapped_rows_correctable is not None:
        yield "correctable", s.remapped_rows_correctable
    if s.remapped_rows_uncorrectable is not None:
        yield "uncorrectable", s.remapped_rows_uncorrectable


def _retired(s: GpuSample) -> Iterable[tuple[str, Number]]:
    if s.retired_pages_single_bit is not None:
        yield "single_bit", s.retired_pages_single_bit
    if s.retired_pages_double_bit is not None:
        yield "double_bit", s.retired_pages_double_bit


def _recovery(s: GpuSample) -> Iterable[tuple[str, Number]]:
    """Every known action, 1 for the current one (an unknown one of a newer driver too)."""
    if s.recovery_action is None:
        return []
    names = dict.fromkeys((*RECOVERY_ACTION_NAMES, s.recovery_action))
    return [(a, 1 if a == s.recovery_action else 0) for a in names]


def _nvlink(s: GpuSample) -> Iterable[tuple[str, Number]]:
    return [
        (f"{link},{kind}", n)
        for link, counts in sorted(s.nvlink_errors_total.items())
        for kind, n in counts.items()
    ]


def _clock_active(s: GpuSample) -> Iterable[tuple[str, Number]]:
    if s.clock_events_active is None:
        return []
    return [(r, 1 if r in s.clock_events_active else 0) for r in CLOCK_EVENT_REASONS]


def _clock_seconds(s: GpuSample) -> Iterable[tuple[str, Number]]:
    return sorted(s.clock_event_seconds_total.items())


def _health_state(s: GpuSample) -> Iterable[tuple[str, Number]]:
    return [(state, 1 if state == s.health_state else 0) for state in STATES]


def _health_action(s: GpuSample) -> Iterable[tuple[str, Number]]:
    return [(a, 1 if a == s.health_action else 0) for a in ACTIONS]


def _gpm(attr: str) -> GpuValues:
    """A GPM ratio: absent on a GPU without GPM and on the first poll (never 0)."""

    def read(s: GpuSample) -> Iterable[tuple[str, Number]]:
        v = getattr(s.gpm, attr) if s.gpm is not None else None
        return () if v is None else (("", v),)

    return read


def _gpm_bytes(attr: str) -> GpuValues:
    def read(s: GpuSample) -> Iterable[tuple[str, Number]]:
        return sorted(getattr(s.gpm, attr).items()) if s.gpm is not None else []

    return read


def _mig_gpm(attr: str) -> MigValue:
    def read(d: MigDevice, m: MigSample | None) -> Number | None:
        return getattr(m.gpm, attr) if m is not None and m.gpm is not None else None

    return read


# GPM (Hopper+; backends/gpm.py): what each ratio means, as DCGM's profiling fields.
_GPM_RATIOS = (
    (
        "sm_active_ratio",
        "Fraction of time at least one warp was active on an SM, averaged "
        "over all SMs (GPM SM_UTIL; DCGM_FI_PROF_SM_ACTIVE).",
    ),
    (
        "sm_occupancy_ratio",
        "Warps resident on the SMs over the most they can hold "
        "(GPM SM_OCCUPANCY; DCGM_FI_PROF_SM_OCCUPANCY).",
    ),
    (
        "tensor_active_ratio",
        "Fraction of time the tensor cores (any of HMMA, IMMA, DMMA) "
        "were busy (GPM ANY_TENSOR_UTIL; DCGM_FI_PROF_PIPE_TENSOR_ACTIVE).",
    ),
    (
        "dram_active_ratio",
        "Device memory bandwidth used over its peak (GPM DRAM_BW_UTIL; DCGM_FI_PROF_DRAM_ACTIVE).",
    ),
    (
        "fp64_active_ratio",
        "Fraction of time the FP64 (non-tensor) pipes were busy "
        "(GPM FP64_UTIL; DCGM_FI_PROF_PIPE_FP64_ACTIVE).",
    ),
)
_GPM_NOTE = " Hopper+ (GPM), over the last poll interval; absent without GPM."


def _info(inv: NodeInventory, g: GpuInfo) -> tuple[str, ...]:
    cuda = ".".join(map(str, inv.cuda_driver_version)) if inv.cuda_driver_version else ""
    return (
        inv.driver_version,
        cuda,
        g.pci_bus_id,
        "{}.{}".format(*g.compute_capability),
        "enabled" if g.mig_enabled else "disabled",
    )


def _mig_used(d: MigDevice, m: MigSample | None) -> Number | None:
    return m.memory_used_bytes if m is not None else None


def _mig_total(d: MigDevice, m: MigSample | None) -> Number | None:
    return d.memory_total_bytes


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
        "XID errors reported by the driver, by XID code.",
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
