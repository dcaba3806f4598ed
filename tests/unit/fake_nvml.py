"""A stand-in for the `pynvml` module with just the API NvmlBackend uses.

Devices are built with small builders (after GPU Feature Discovery's test style):
`FakeGpu(...)`, then `.lost()`, `.unsupported("nvmlDeviceGetPowerUsage")`.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml as real

# Reuse the real constants so the backend's comparisons are exercised as in production.
CONSTANTS = {k: getattr(real, k) for k in dir(real) if k.startswith(("NVML_", "nvmlEventType"))}
CONSTANTS["nvmlMemory_v2"] = real.nvmlMemory_v2
# The real GPM metrics struct: the backend fills it as it would for libnvidia-ml.
CONSTANTS["c_nvmlGpmMetricsGet_t"] = real.c_nvmlGpmMetricsGet_t

# What an H100 under a matrix-multiply load reads, by GPM metric id (percent, MiB/s).
GPM_VALUES: dict[int, float] = {
    real.NVML_GPM_METRIC_SM_UTIL: 80.0,
    real.NVML_GPM_METRIC_SM_OCCUPANCY: 40.0,
    real.NVML_GPM_METRIC_ANY_TENSOR_UTIL: 60.0,
    real.NVML_GPM_METRIC_DRAM_BW_UTIL: 100.3,  # GPM's rounding can pass 100
    real.NVML_GPM_METRIC_FP64_UTIL: 0.0,
    real.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC: 1000.0,
    real.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC: 500.0,
    real.NVML_GPM_METRIC_PCIE_TX_PER_SEC: 10.0,
    real.NVML_GPM_METRIC_PCIE_RX_PER_SEC: 20.0,
}


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


@dataclass
class FakeMig:
    """A MIG device as NVML describes it (nvmlDeviceGetAttributes_v2's fields)."""

    profile: str  # the name NVML gives ends in it: "NVIDIA H100 80GB HBM3 MIG 1g.10gb"
    uuid: str
    attrs: dict[str, int]
    memory_total: int = 9984 * 2**20
    gi: int = 1


@dataclass
class FakeGpu:
    name: str = "NVIDIA H100 80GB HBM3"
    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    memory_total: int = 81559 * 2**20
    memory_used: int = 1024 * 2**20
    cc: tuple[int, int] = (9, 0)
    util: tuple[int, int] = (42, 17)
    temp: int = 51
    power_mw: int = 250_000
    energy_mj: int = 9_000_000
    sbe: int = 0
    dbe: int = 0
    is_lost: bool = False
    missing: set[str] = field(default_factory=set)
    migs: list[FakeMig] | None = None  # None: MIG off; a list: MIG on, these devices
    # Health signals: (correctable, uncorrectable, pending, failure) remapped rows; the
    # clock events mask; the recovery action code; throttle durations (ns) by field id;
    # retired pages (single-bit, double-bit, pending) or None: unsupported (Ampere+);
    # NVLink links up, and error counts by (link, counter).
    remapped: tuple[int, int, int, int] = (0, 0, 0, 0)
    clock_mask: int = 0
    recovery: int = 0
    durations_ns: dict[int, int] = field(default_factory=dict)
    retired: tuple[list[int], list[int], int] | None = None
    nvlink_up: int = 0
    nvlink_errors: dict[tuple[int, int], int] = field(default_factory=dict)
    # GPM (Hopper+): off by default, so the older tests' call counts stay as they were.
    # Metric values by id (a missing id is NOT_SUPPORTED per metric, as NVLink on a PCIe
    # card); whether its GPU instances can be sampled (MIG on).
    gpm: bool = False
    gpm_values: dict[int, float] = field(default_factory=lambda: dict(GPM_VALUES))
    gpm_mig: bool = True

    def lost(self) -> FakeGpu:
        self.is_lost = True
        return self

    def unsupported(self, *fns: str) -> FakeGpu:
        self.missing |= set(fns)
        return self


class FakeNvml:
    """Module-like object: attributes are the pynvml functions and constants."""

    def __init__(
        self,
        gpus: list[FakeGpu],
        init_error: int | None = None,
        memory_v2: bool = True,
        field_values: bool = True,
    ) -> None:
        self.__dict__.update(CONSTANTS)
        self.NVMLError = NVMLError
        self.gpus = gpus
        self.init_error = init_error
        self.memory_v2 = memory_v2
        self.field_values = field_values
        self.calls: list[str] = []
        self.shutdowns = 0
        self.no_handle: set[int] = set()  # indices whose handle lookup fails
        self.identity_error: set[int] = set()  # indices whose name read fails (not lost)
        # GPM sample buffers: address -> (filled by: (gpu, gi) or None, sequence number).
        self.gpm_samples: dict[int, tuple[tuple[int, int | None] | None, int]] = {}
        self._gpm_buffers: dict[int, ctypes.c_uint64] = {}
        self._gpm_seq = 0

    def _gpu(self, h: Any, fn: str) -> FakeGpu:
        self.calls.append(fn)
        g: FakeGpu = self.gpus[h]
        if g.is_lost:
            raise NVMLError(real.NVML_ERROR_GPU_IS_LOST)
        if fn in g.missing:
            raise NVMLError(real.NVML_ERROR_NOT_SUPPORTED)
        return g

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise NVMLError(self.init_error)

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    # XID events: queue (device index, xid) pairs in `events`; waits time out when empty.
    events: list[tuple[int, int]]

    def nvmlEventSetCreate(self) -> str:
        self.__dict__.setdefault("events", [])
        return "evset"

    def nvmlDeviceRegisterEvents(self, h: int, types: int, evset: str) -> None:
        self.calls.append(f"register:{h}")

    def nvmlEventSetWait(self, evset: str, timeout_ms: int) -> Any:
        import time

        if self.__dict__.get("events"):
            h, xid = self.events.pop(0)
            return SimpleNamespace(
                device=h, eventType=real.nvmlEventTypeXidCriticalError, eventData=xid
            )
        time.sleep(min(timeout_ms, 20) / 1000)  # the real call blocks until its time-out
        raise NVMLError(real.NVML_ERROR_TIMEOUT)

    def nvmlEventSetFree(self, evset: str) -> None:
        self.calls.append("evset-free")

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        if i in self.no_handle:
            raise NVMLError(real.NVML_ERROR_GPU_IS_LOST)
        return i

    def nvmlSystemGetDriverVersion(self) -> str:
        return "550.54.15"

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return 12040

    # MIG devices: handles are ("mig", gpu index, slot).
    def _mig(self, h: Any, fn: str) -> FakeMig:
        self.calls.append(fn)
        g = self.gpus[h[1]]
        if fn in g.missing:
            raise NVMLError(real.NVML_ERROR_NOT_SUPPORTED)
        return (g.migs or [])[h[2]]

    def nvmlDeviceGetMaxMigDeviceCount(self, h: int) -> int:
        self._gpu(h, "nvmlDeviceGetMaxMigDeviceCount")
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: int, k: int) -> Any:
        g = self._gpu(h, "nvmlDeviceGetMigDeviceHandleByIndex")
        if k >= len(g.migs or []):
            raise NVMLError(real.NVML_ERROR_NOT_FOUND)
        return ("mig", h, k)

    def nvmlDeviceGetHandleByUUID(self, uuid: bytes) -> Any:
        for i, g in enumerate(self.gpus):
            for k, m in enumerate(g.migs or []):
                if m.uuid.encode() == uuid:
                    return ("mig", i, k)
        raise NVMLError(real.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetAttributes_v2(self, h: Any) -> Any:
        return SimpleNamespace(**self._mig(h, "nvmlDeviceGetAttributes_v2").attrs)

    def nvmlDeviceGetGpuInstanceId(self, h: Any) -> int:
        return self._mig(h, "nvmlDeviceGetGpuInstanceId").gi

    def nvmlDeviceGetComputeInstanceId(self, h: Any) -> int:
        self._mig(h, "nvmlDeviceGetComputeInstanceId")
        return 0

    def nvmlDeviceGetName(self, h: Any) -> str:
        if isinstance(h, tuple):
            m = self._mig(h, "nvmlDeviceGetName")
            return f"{self.gpus[h[1]].name} MIG {m.profile}"
        if h in self.identity_error:
            raise NVMLError(real.NVML_ERROR_UNKNOWN)
        return self._gpu(h, "nvmlDeviceGetName").name

    def nvmlDeviceGetUUID(self, h: Any) -> str:
        if isinstance(h, tuple):
            return self._mig(h, "nvmlDeviceGetUUID").uuid
        return self._gpu(h, "nvmlDeviceGetUUID").uuid

    def nvmlDeviceGetMemoryInfo(self, h: Any, version: int | None = None) -> Any:
        if isinstance(h, tuple):
            m = self._mig(h, "nvmlDeviceGetMemoryInfo")
            return SimpleNamespace(total=m.memory_total, used=2**20, free=m.memory_total - 2**20)
        g = self._gpu(h, "nvmlDeviceGetMemoryInfo")
        if version is not None and not self.memory_v2:
            raise NVMLError(real.NVML_ERROR_FUNCTION_NOT_FOUND)
        return SimpleNamespace(
            total=g.memory_total, used=g.memory_used, free=g.memory_total - g.memory_used
        )

    def nvmlDeviceGetCudaComputeCapability(self, h: int) -> tuple[int, int]:
        return self._gpu(h, "nvmlDeviceGetCudaComputeCapability").cc

    def nvmlDeviceGetPciInfo(self, h: int) -> Any:
        self._gpu(h, "nvmlDeviceGetPciInfo")
        return SimpleNamespace(busId=f"00000000:{h:02X}:00.0".encode())

    def nvmlDeviceGetMigMode(self, h: int) -> tuple[int, int]:
        g = self._gpu(h, "nvmlDeviceGetMigMode")
        on = real.NVML_DEVICE_MIG_ENABLE if g.migs is not None else real.NVML_DEVICE_MIG_DISABLE
        return (on, on)

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:
        g = self._gpu(h, "nvmlDeviceGetUtilizationRates")
        return SimpleNamespace(gpu=g.util[0], memory=g.util[1])

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        return self._gpu(h, "nvmlDeviceGetTemperature").temp

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        return self._gpu(h, "nvmlDeviceGetPowerUsage").power_mw

    def nvmlDeviceGetClockInfo(self, h: int, kind: int) -> int:
        self._gpu(h, "nvmlDeviceGetClockInfo")
        return 1980 if kind == real.NVML_CLOCK_SM else 2619

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[Any]:
        self._gpu(h, "nvmlDeviceGetComputeRunningProcesses")
        return [SimpleNamespace(pid=1), SimpleNamespace(pid=2)]

    def nvmlDeviceGetTotalEccErrors(self, h: int, error_type: int, counter: int) -> int:
        g = self._gpu(h, "nvmlDeviceGetTotalEccErrors")
        assert counter == real.NVML_VOLATILE_ECC
        if f"ecc:{error_type}" in g.missing:
            raise NVMLError(real.NVML_ERROR_NOT_SUPPORTED)
        return g.sbe if error_type == real.NVML_MEMORY_ERROR_TYPE_CORRECTED else g.dbe

    def nvmlDeviceGetTotalEnergyConsumption(self, h: int) -> int:
        return self._gpu(h, "nvmlDeviceGetTotalEnergyConsumption").energy_mj

    def nvmlDeviceGetFieldValues(self, h: int, ids: list[int]) -> list[Any]:
        g = self._gpu(h, "nvmlDeviceGetFieldValues")
        if not self.field_values:
            raise NVMLError(real.NVML_ERROR_FUNCTION_NOT_FOUND)
        table = {
            real.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION: g.energy_mj,
            real.NVML_FI_DEV_ECC_SBE_VOL_TOTAL: g.sbe,
            real.NVML_FI_DEV_ECC_DBE_VOL_TOTAL: g.dbe,
            real.NVML_FI_DEV_NVLINK_LINK_COUNT: 18,
            real.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION: g.recovery,
            real.NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN: 0,
            real.NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN: 0,
            real.NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN: 0,
            **g.durations_ns,
        }
        out = []
        for i in ids:
            ok = i in table and f"field:{i}" not in g.missing
            out.append(
                SimpleNamespace(
                    fieldId=i,
                    nvmlReturn=real.NVML_SUCCESS if ok else real.NVML_ERROR_NOT_SUPPORTED,
                    valueType=real.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG,
                    value=SimpleNamespace(ullVal=table.get(i, 0)),
                )
            )
        return out

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: int) -> int:
        return self._gpu(h, "nvmlDeviceGetCurrentClocksEventReasons").clock_mask

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h: int) -> int:
        return self._gpu(h, "nvmlDeviceGetCurrentClocksThrottleReasons").clock_mask

    def nvmlDeviceGetRemappedRows(self, h: int) -> tuple[int, int, int, int]:
        return self._gpu(h, "nvmlDeviceGetRemappedRows").remapped

    def nvmlDeviceGetRetiredPages(self, h: int, cause: int) -> list[int]:
        g = self._gpu(h, "nvmlDeviceGetRetiredPages")
        if g.retired is None:
            raise NVMLError(real.NVML_ERROR_NOT_SUPPORTED)
        return g.retired[cause]

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h: int) -> int:
        g = self._gpu(h, "nvmlDeviceGetRetiredPagesPendingStatus")
        if g.retired is None:
            raise NVMLError(real.NVML_ERROR_NOT_SUPPORTED)
        return g.retired[2]

    def nvmlDeviceGetNvLinkState(self, h: int, link: int) -> int:
        g = self._gpu(h, "nvmlDeviceGetNvLinkState")
        return real.NVML_FEATURE_ENABLED if link < g.nvlink_up else real.NVML_FEATURE_DISABLED

    def nvmlDeviceGetNvLinkErrorCounter(self, h: int, link: int, counter: int) -> int:
        g = self._gpu(h, "nvmlDeviceGetNvLinkErrorCounter")
        return g.nvlink_errors.get((link, counter), 0)

    # -- GPM, with the call sequence and error codes of libnvidia-ml -----------------
    #
    # nvmlGpmQueryDeviceSupport: success with isSupportedDevice 0 on a GPU without GPM
    # (before Hopper); the sample calls then fail NOT_SUPPORTED. nvmlGpmMetricsGet needs a
    # struct of NVML_GPM_METRICS_GET_VERSION and two samples of the same device, the
    # second taken after the first; otherwise it fails INVALID_ARGUMENT (what the backend
    # meets with too few samples). A metric the GPU lacks fails alone, in its nvmlReturn.

    def nvmlGpmQueryDeviceSupport(self, h: int) -> Any:
        g = self._gpu(h, "nvmlGpmQueryDeviceSupport")
        return SimpleNamespace(version=real.NVML_GPM_SUPPORT_VERSION, isSupportedDevice=int(g.gpm))

    def nvmlGpmSampleAlloc(self) -> Any:
        self.calls.append("nvmlGpmSampleAlloc")
        buf = ctypes.c_uint64(0)
        addr = ctypes.addressof(buf)
        self._gpm_buffers[addr] = buf
        self.gpm_samples[addr] = (None, 0)
        return ctypes.cast(ctypes.pointer(buf), real.c_nvmlGpmSample_t)

    def nvmlGpmSampleFree(self, sample: Any) -> None:
        self.calls.append("nvmlGpmSampleFree")
        addr = _address(sample)
        if addr not in self.gpm_samples:
            raise NVMLError(real.NVML_ERROR_INVALID_ARGUMENT)
        del self.gpm_samples[addr], self._gpm_buffers[addr]

    def _gpm_fill(self, sample: Any, owner: tuple[int, int | None]) -> None:
        addr = _address(sample)
        if addr not in self.gpm_samples:
            raise NVMLError(real.NVML_ERROR_INVALID_ARGUMENT)
        self._gpm_seq += 1
        self.gpm_samples[addr] = (owner, self._gpm_seq)

    def nvmlGpmSampleGet(self, h: int, sample: Any) -> Any:
        g = self._gpu(h, "nvmlGpmSampleGet")
        if not g.gpm:
            raise NVMLError(real.NVML_ERROR_NOT_SUPPORTED)
        self._gpm_fill(sample, (h, None))
        return sample

    def nvmlGpmMigSampleGet(self, h: int, gi: int, sample: Any) -> Any:
        g = self._gpu(h, "nvmlGpmMigSampleGet")
        if not (g.gpm and g.gpm_mig) or g.migs is None:
            raise NVMLError(real.NVML_ERROR_NOT_SUPPORTED)
        if gi not in {m.gi for m in g.migs}:
            raise NVMLError(real.NVML_ERROR_NOT_FOUND)
        self._gpm_fill(sample, (h, gi))
        return sample

    def nvmlGpmMetricsGet(self, mg: Any) -> Any:
        self.calls.append("nvmlGpmMetricsGet")
        if mg.version != real.NVML_GPM_METRICS_GET_VERSION:
            raise NVMLError(real.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        first = self.gpm_samples.get(_address(mg.sample1), (None, 0))
        second = self.gpm_samples.get(_address(mg.sample2), (None, 0))
        if first[0] is None or first[0] != second[0] or second[1] <= first[1]:
            raise NVMLError(real.NVML_ERROR_INVALID_ARGUMENT)
        g = self.gpus[first[0][0]]
        if g.is_lost:
            raise NVMLError(real.NVML_ERROR_GPU_IS_LOST)
        for k in range(mg.numMetrics):
            m = mg.metrics[k]
            if m.metricId in g.gpm_values:
                m.nvmlReturn, m.value = real.NVML_SUCCESS, g.gpm_values[m.metricId]
            else:
                m.nvmlReturn, m.value = real.NVML_ERROR_NOT_SUPPORTED, 0.0
        return mg


def _address(sample: Any) -> int:
    return ctypes.cast(sample, ctypes.c_void_p).value or 0
