"""The data that flows from a backend through the cache to every sink.

Units live in field names and are converted once, in the backend. `None` means
"not supported or not read", never zero.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field

MIB = 1024 * 1024


@dataclass(frozen=True)
class MigDevice:
    """One MIG instance (a GPU instance + compute instance pair)."""

    uuid: str
    profile: str  # e.g. "1g.10gb"
    gpu_instance_id: int
    compute_instance_id: int
    memory_total_bytes: int
    # What GFD labels per profile (nvmlDeviceGetAttributes_v2); None: not read.
    multiprocessors: int | None = None
    gpu_instance_slices: int | None = None
    compute_instance_slices: int | None = None
    copy_engines: int | None = None
    decoders: int | None = None
    encoders: int | None = None
    jpeg_engines: int | None = None
    ofa_engines: int | None = None

    @property
    def memory_total_mib(self) -> int:
        return self.memory_total_bytes // MIB


@dataclass(frozen=True)
class GpuInfo:
    """Slow-changing facts about one GPU, read on the inventory schedule."""

    index: int
    uuid: str
    name: str
    memory_total_bytes: int
    compute_capability: tuple[int, int]
    pci_bus_id: str = ""
    mig_capable: bool = False
    mig_enabled: bool = False
    mig_devices: tuple[MigDevice, ...] = ()
    nvlink_links: int | None = None

    @property
    def memory_total_mib(self) -> int:
        return self.memory_total_bytes // MIB


@dataclass(frozen=True)
class NodeInventory:
    """Everything the inventory job learns about the node's GPUs."""

    driver_version: str  # e.g. "550.54.15"
    cuda_driver_version: tuple[int, int] | None  # e.g. (12, 4)
    gpus: tuple[GpuInfo, ...]
    backend: str = "nvml"  # "nvml" | "simulated"


@dataclass(frozen=True)
class GpmReading:
    """GPU Performance Monitoring (Hopper+) over the interval between two telemetry polls:
    activity ratios 0..1 (GPM's percentages / 100) and byte counters the backend
    integrates from GPM's MiB/s rates. None / empty: not supported by this GPU."""

    sm_active_ratio: float | None = None
    sm_occupancy_ratio: float | None = None
    tensor_active_ratio: float | None = None
    dram_active_ratio: float | None = None
    fp64_active_ratio: float | None = None
    # direction ("tx", "rx") -> bytes since the agent started reading (monotonic).
    nvlink_bytes_total: Mapping[str, int] = field(default_factory=dict)
    pcie_bytes_total: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class MigSample:
    uuid: str
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    # GPM of the MIG device's GPU instance (nvmlGpmMigSampleGet); None: no GPM.
    gpm: GpmReading | None = None


@dataclass(frozen=True)
class GpuSample:
    """One telemetry reading of one GPU. Unsupported readings are None."""

    index: int
    uuid: str
    healthy: bool = True  # schedulable: the verdict's state is not "unhealthy"
    health_reason: str = ""  # why not healthy: "gpu lost", "xid 79", "row remap pending", ...
    lost: bool = False
    # The verdict (health/verdict.py): healthy | degraded | unhealthy, and the action
    # it needs: none | watch | drain | reset_gpu | reboot_node | replace.
    health_state: str = "healthy"
    health_action: str = "none"
    gpu_utilization_ratio: float | None = None
    memory_utilization_ratio: float | None = None
    memory_used_bytes: int | None = None
    memory_free_bytes: int | None = None
    memory_total_bytes: int | None = None
    temperature_celsius: float | None = None
    power_watts: float | None = None
    energy_joules_total: float | None = None
    sm_clock_hertz: float | None = None
    memory_clock_hertz: float | None = None
    ecc_corrected_errors_total: int | None = None
    ecc_uncorrected_errors_total: int | None = None
    process_count: int | None = None
    xid_errors_total: Mapping[int, int] = field(default_factory=dict)
    mig: tuple[MigSample, ...] = ()
    # Row remapping (Ampere and later; nvmlDeviceGetRemappedRows).
    remapped_rows_correctable: int | None = None
    remapped_rows_uncorrectable: int | None = None
    row_remap_pending: bool | None = None
    row_remap_failed: bool | None = None
    # The driver's recovery action (health/signals.py names): "none", "gpu_reset", ...
    recovery_action: str | None = None
    # Retired pages (before Ampere; nvmlDeviceGetRetiredPages), by cause.
    retired_pages_single_bit: int | None = None
    retired_pages_double_bit: int | None = None
    retired_pages_pending: bool | None = None
    # NVLink error counters: link -> type (replay, recovery, crc_flit, crc_data) -> count.
    # Empty: no NVLink, or not readable.
    nvlink_errors_total: Mapping[int, Mapping[str, int]] = field(default_factory=dict)
    # Clock event reasons that mean a fault (hw_slowdown, hw_thermal, sw_thermal,
    # hw_power_brake) active now; None: not readable. Seconds spent in each so far.
    clock_events_active: frozenset[str] | None = None
    clock_event_seconds_total: Mapping[str, float] = field(default_factory=dict)
    # GPM (issue 33): None on a GPU without GPM, and on the first poll (no pair yet).
    gpm: GpmReading | None = None

    def __post_init__(self) -> None:
        # `healthy=False` alone (a caller from before the verdict) means unhealthy.
        if not self.healthy and self.health_state != "unhealthy":
            object.__setattr__(self, "health_state", "unhealthy")


@dataclass(frozen=True)
class PodRef:
    """The container a GPU or MIG instance is assigned to (kubelet pod-resources)."""

    pod: str
    namespace: str
    container: str


# device id (GPU or MIG UUID) -> the container it is assigned to
PodMap = Mapping[str, PodRef]


@dataclass(frozen=True)
class Snapshot:
    """What the cache hands out: immutable, so readers never need a lock.

    `*_at` are wall-clock UNIX seconds (for people, InfluxDB timestamps and the
    staleness bound); 0.0 means "never".
    """

    inventory: NodeInventory | None = None
    inventory_at: float = 0.0
    samples: tuple[GpuSample, ...] = ()
    samples_at: float = 0.0
    sample_seq: int = 0  # increments with every telemetry poll
    # The newest energy counter read of each GPU (its own, slower schedule), already
    # merged into `samples` as energy_joules_total; kept to merge into the next samples.
    energy_joules: Mapping[int, float] = field(default_factory=dict)
    energy_at: float = 0.0

    def sample_for(self, index: int) -> GpuSample | None:
        return self._by_index.get(index)

    @functools.cached_property
    def _by_index(self) -> dict[int, GpuSample]:
        # Built once per snapshot (readers look up every GPU of it); the instance dict
        # is written directly, so this works on a frozen dataclass.
        return {s.index: s for s in self.samples}
