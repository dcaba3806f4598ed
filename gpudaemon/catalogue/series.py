"""The catalogue's row type and what every row shares: the series prefix, the labels
every per-GPU and per-MIG series carries, the InfluxDB measurements, and the small
builders of plain rows."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

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
