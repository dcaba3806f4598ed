"""The one small interface every GPU source implements: NVML, simulated, recorded."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

from gpudaemon.health.xid import APPLICATION_XIDS, xid_rule
from gpudaemon.model import GpuSample, NodeInventory
from gpudaemon.remediation.nvsmi import ToolResult

__all__ = ["APPLICATION_XIDS"]  # re-exported: the XID table lives in health/xid.py


LOST_REASON = "gpu lost"


def is_critical_xid(xid: int) -> bool:
    """An XID that makes the GPU unhealthy, by the XID table (health/xid.py)."""
    return xid_rule(xid, APPLICATION_XIDS).state == "unhealthy"


def health_reason(*, lost: bool, critical_xid: int | None, ecc_uncorrected: int | None) -> str:
    """The one health policy for every backend: why a GPU is unhealthy, "" if it is not.

    Precedence: a lost GPU, then the first critical XID seen (sticky until the driver
    reloads, as the counters are), then uncorrected ECC errors.
    """
    if lost:
        return LOST_REASON
    if critical_xid is not None:
        return f"xid {critical_xid}"
    if ecc_uncorrected:
        return STICKY_ECC_REASON
    return ""


STICKY_ECC_REASON = "ecc uncorrected errors"
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


def is_sticky(reason: str) -> bool:
    """Faults that need a GPU or node reset to clear: a critical XID or uncorrected ECC.
    They are remembered across agent restarts (healthmemory.py); a lost GPU is not
    remembered because NVML itself keeps reporting it lost until the reset."""
    return reason.startswith("xid ") or reason == STICKY_ECC_REASON


def host_boot_id(path: str = BOOT_ID_PATH) -> str:
    """The kernel's boot ID: a new one means the node (and every GPU) was reset."""
    try:
        with open(path, encoding="ascii") as f:
            return f.read(64).strip()
    except (OSError, UnicodeDecodeError):
        return ""


def lost_sample(index: int, uuid: str, xid_errors_total: Mapping[int, int]) -> GpuSample:
    """What a lost GPU reports: unhealthy, no readings (absent, not 0), its XID counts."""
    return GpuSample(
        index=index,
        uuid=uuid,
        healthy=False,
        health_reason=LOST_REASON,
        health_state="unhealthy",
        health_action="reboot_node",
        lost=True,
        xid_errors_total=dict(xid_errors_total),
    )


# The NVML calls one GPU's telemetry sample makes (NvmlBackend.sample), and the ones its
# energy read makes (NvmlBackend.energy): a unit test holds the NVML backend to these,
# and the simulator charges a GPU's latency profile for the same calls, so a design that
# puts a slow call on the hot path costs on simulated GPUs what it costs on real ones.
SAMPLE_CALLS: tuple[str, ...] = (
    "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetTemperature",
    "nvmlDeviceGetPowerUsage",
    "nvmlDeviceGetClockInfo",  # SM
    "nvmlDeviceGetClockInfo",  # memory
    "nvmlDeviceGetComputeRunningProcesses",
    "nvmlDeviceGetTotalEccErrors",  # corrected
    "nvmlDeviceGetTotalEccErrors",  # uncorrected
    "nvmlDeviceGetCurrentClocksEventReasons",
    "nvmlDeviceGetRemappedRows",
)
ENERGY_CALLS: tuple[str, ...] = ("nvmlDeviceGetTotalEnergyConsumption",)
# The health counters' read (NvmlBackend.health_counters, `schedules.health`): one
# field-values call for the recovery action and the clock-event durations (its own
# name: the measured `nvmlDeviceGetFieldValues` cost is the energy field's), the retired
# pages (before Ampere only), and per active NVLink link one call per error counter.
HEALTH_FIELDS_CALL = "nvmlDeviceGetFieldValues(health)"
HEALTH_CALLS: tuple[str, ...] = (HEALTH_FIELDS_CALL,)
RETIRED_PAGES_CALLS: tuple[str, ...] = (
    "nvmlDeviceGetRetiredPages",  # multiple single-bit
    "nvmlDeviceGetRetiredPages",  # double-bit
    "nvmlDeviceGetRetiredPagesPendingStatus",
)
NVLINK_CALL = "nvmlDeviceGetNvLinkErrorCounter"  # x 4 counters x active links
# GPM (Hopper+, probed once per GPU): every sample of a GPU that has it takes one GPM
# sample and computes the metrics from it and the previous poll's sample; with MIG on,
# the same again per GPU instance (backends/gpm.py).
GPM_CALLS: tuple[str, ...] = ("nvmlGpmSampleGet", "nvmlGpmMetricsGet")
GPM_MIG_CALLS: tuple[str, ...] = ("nvmlGpmMigSampleGet", "nvmlGpmMetricsGet")


class Backend(Protocol):
    """A source of GPU inventory and samples.

    `sample()` never raises for a single bad GPU: that GPU comes back with
    `healthy=False` and the others carry on. It raises BackendError only when the
    whole node is unreadable.
    """

    name: str

    def inventory(self) -> NodeInventory: ...

    def sample(self) -> tuple[GpuSample, ...]:
        """Every GPU's telemetry, without the energy counter (see `energy`)."""
        ...

    def energy(self) -> dict[int, float | None]:
        """Each GPU's energy counter in joules, by index (None: not readable now). A
        slow call on real GPUs, so it has its own schedule (`schedules.energy`)."""
        ...

    def health_counters(self) -> None:
        """Read the slower health signals (NVLink error counters, retired pages, the
        recovery action, clock-event durations) on `schedules.health`; the next samples
        carry them."""
        ...

    def subscribe(self, listener: Callable[[int, int], None]) -> None:
        """Call `listener(index, xid)` for every XID when the driver reports it (NVML's
        event set; the simulator's of the same API), not at the next poll."""
        ...

    def reset_gpu(self, index: int, tool: str, timeout_s: float) -> ToolResult:
        """Reset one GPU with the host driver's `tool` (nvidia-smi), letting go of it
        meanwhile; never raises. The next samples read the GPU afresh."""
        ...

    def boot_id(self) -> str:
        """Changes when the GPUs are reset (a node reboot); "" if unknown."""
        ...

    def close(self) -> None: ...
