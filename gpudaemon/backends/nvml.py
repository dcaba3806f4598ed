"""The only module that talks to NVML (through nvidia-ml-py's `pynvml`).

Owns: lazy init under a lock, shutdown, versioned-symbol fallbacks (probed once),
unit conversion (mW -> W, mJ -> J, MHz -> Hz, percent -> ratio), "not supported" ->
None, GPU-lost isolation, and the XID event thread.

Cost (measured on an H100, ../docs/benchmarks.md): every telemetry call takes 2-10 us,
but the energy counter takes ~3.9 ms, so it is read by `energy()` on its own slower
schedule, never by `sample()`. The calls each step makes are `SAMPLE_CALLS` and
`ENERGY_CALLS` (backends/base.py); the simulator charges its latency profile for the
same ones. A reading a GPU does not support is asked once, then not again; the first
read of each reading on each GPU is timed, and one over SLOW_CALL_S is logged.

GPM (Hopper+; issue 33): support is probed once per GPU at inventory. Each sample of a
GPU with GPM takes one GPM sample and computes the metrics from it and the previous
poll's (so the pair spans the poll interval, no extra wait; the first poll has none);
with MIG on, the same per GPU instance. The arithmetic is in backends/gpm.py.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, cast

from loguru import logger

from gpudaemon.backends import gpm
from gpudaemon.backends.base import NVLINK_CALL, host_boot_id, is_critical_xid, lost_sample
from gpudaemon.errors import BackendError, NvmlUnavailableError
from gpudaemon.health import signals
from gpudaemon.health.verdict import judge
from gpudaemon.logsetup import LogLimiter
from gpudaemon.model import (
    MIB,
    GpmReading,
    GpuInfo,
    GpuSample,
    MigDevice,
    MigSample,
    NodeInventory,
)

# A first read at least this slow is logged (the energy counter: ~3.9 ms on an H100).
SLOW_CALL_S = 0.001
_timer = time.perf_counter  # the probe's clock (a test replaces it)
_clock = time.monotonic  # the GPM interval's clock (a test replaces it)


class _Unsupported(Exception):
    """A reading this GPU or driver does not offer: maps to None, never 0."""


class _Lost(Exception):
    """NVML_ERROR_GPU_IS_LOST for one GPU."""


@dataclass
class _GpmPair:
    """One GPU's (or GPU instance's) GPM state: two sample buffers from
    nvmlGpmSampleAlloc (`prev` holds the previous poll's sample when `at` is set), the
    metrics struct (reused), the metric ids it said are unsupported, the counters."""

    prev: Any
    cur: Any
    metrics: Any
    at: float | None = None  # monotonic time `prev` was taken; None: no previous sample
    skip: set[int] = field(default_factory=set)
    counters: gpm.Counters = field(default_factory=gpm.Counters)


def _import_pynvml() -> ModuleType:
    try:
        import pynvml
    except ImportError as e:  # pragma: no cover - nvidia-ml-py is a hard dependency
        raise NvmlUnavailableError(f"cannot import pynvml (install nvidia-ml-py): {e}") from None
    return cast(ModuleType, pynvml)


class NvmlBackend:
    """Backend over NVML. `nvml` may be a stand-in module with the same API (tests)."""

    name = "nvml"

    def __init__(self, nvml: ModuleType | None = None, xid_events: bool = True) -> None:
        self._nvml = nvml or _import_pynvml()
        self._lock = threading.Lock()
        self._initialised = False
        self._handles: list[Any] = []
        self._infos: dict[int, GpuInfo] = {}
        self._lost: set[int] = set()
        self._xids: dict[int, dict[int, int]] = {}
        self._first_critical_xid: dict[int, int] = {}
        self._warn_once = LogLimiter()  # per (reading, GPU): once, ever
        self._bad_identity: set[tuple[int, str]] = set()
        self._xid_lock = threading.Lock()  # the event thread writes, sample() reads
        self._memory_v2: bool | None = None  # probed once: nvmlDeviceGetMemoryInfo_v2 usable?
        self._field_values: bool | None = None  # probed once: nvmlDeviceGetFieldValues usable?
        # (GPU, reading) pairs NVML said are not supported: never asked again.
        self._unsupported: set[tuple[int, str]] = set()
        self._probed: set[tuple[int, str]] = set()  # first read timed
        self.first_read_s: dict[tuple[int, str], float] = {}  # what each probe found
        self._want_xid_events = xid_events
        # The health counters' newest read per GPU (health_counters), merged into every
        # sample; the NVLink links that are up, probed once per GPU; the field ids a GPU
        # said are unsupported; GPUs whose recovery action changed (XID 154).
        self._health: dict[int, dict[str, Any]] = {}
        self._nvlinks: dict[int, tuple[int, ...]] = {}
        self._unsupported_fields: set[tuple[int, int]] = set()
        self._recovery_changed: set[int] = set()
        # GPM: support per GPU (probed once); per GPU (gi None) or GPU instance, its pair;
        # GPUs whose GPU instances said GPM is not supported.
        self._gpm_support: dict[int, bool] = {}
        self._gpm: dict[tuple[int, int | None], _GpmPair] = {}
        self._gpm_no_mig: set[int] = set()
        self._gpm_ids: dict[int, tuple[str, str]] | None = None
        self._stop = threading.Event()
        self._xid_thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------

    def _ensure_init(self) -> None:
        if self._initialised:
            return
        n = self._nvml
        try:
            n.nvmlInit()
        except n.NVMLError as e:
            code = getattr(e, "value", None)
            if code in (n.NVML_ERROR_LIBRARY_NOT_FOUND, n.NVML_ERROR_DRIVER_NOT_LOADED):
                raise NvmlUnavailableError(
                    f"NVML is not available ({e}); is the NVIDIA driver installed and the "
                    "container started with the NVIDIA runtime? Use --simulate to run without a GPU"
                ) from None
            raise BackendError(f"nvmlInit failed: {e}") from None
        except OSError as e:
            raise NvmlUnavailableError(f"NVML is not available: {e}") from None
        try:
            count = n.nvmlDeviceGetCount()
        except n.NVMLError as e:
            raise BackendError(f"cannot count GPUs: {e}") from None
        self._handles = []
        for i in range(count):
            try:
                self._handles.append(n.nvmlDeviceGetHandleByIndex(i))
            except n.NVMLError as e:  # one GPU already gone must not hide the others
                logger.error("GPU {}: no handle ({}); reporting it unhealthy", i, e)
                self._handles.append(None)
                self._lost.add(i)
        self._initialised = True
        if self._want_xid_events and self._handles:
            self._xid_thread = threading.Thread(
                target=self._xid_loop, name="nvml-xid-events", daemon=True
            )
            self._xid_thread.start()

    def boot_id(self) -> str:
        return host_boot_id()

    def close(self) -> None:
        self._stop.set()
        if self._xid_thread is not None:
            self._xid_thread.join(timeout=3)
        with self._lock:
            if self._initialised:
                for i in {k[0] for k in self._gpm}:
                    self._gpm_free(i)
                try:
                    self._nvml.nvmlShutdown()
                except self._nvml.NVMLError as e:
                    logger.debug("nvmlShutdown: {}", e)
                self._initialised = False

    # -- error mapping -----------------------------------------------------------

    def _call(self, fn_name: str, *args: Any) -> Any:
        """Call an NVML function by name; a symbol this binding or driver lacks is
        unsupported (logged once), GPU-lost and not-supported map to our exceptions."""
        n = self._nvml
        fn = getattr(n, fn_name, None)
        if fn is None:
            if self._warn_once.allow((fn_name, -2)):
                logger.info("NVML function {} not available; its readings are absent", fn_name)
            raise _Unsupported()
        try:
            return fn(*args)
        except n.NVMLError as e:
            code = getattr(e, "value", None)
            if code == n.NVML_ERROR_GPU_IS_LOST:
                raise _Lost() from None
            if code in (n.NVML_ERROR_NOT_SUPPORTED, n.NVML_ERROR_FUNCTION_NOT_FOUND):
                raise _Unsupported() from None
            raise

    def _read(self, index: int, what: str, fn: str, *args: Any) -> Any:
        """One reading: None when unsupported (then never asked again on this GPU) or
        failing (logged once); _Lost propagates. The first read of each reading on each
        GPU is timed: the probe that tells a slow call from a cheap one."""
        key = (index, what)
        if key in self._unsupported:
            return None
        probe = key not in self._probed
        start = _timer() if probe else 0.0
        try:
            value = self._call(fn, *args)
        except _Unsupported:
            self._unsupported.add(key)
            if index >= 0:
                logger.info("GPU {}: {} is not supported; not read again", index, what)
            return None
        except self._nvml.NVMLError as e:
            if self._warn_once.allow((what, index)):
                logger.warning("GPU {}: reading {} failed: {}", index, what, e)
            return None
        if probe:
            self._probed.add(key)
            took = self.first_read_s[key] = _timer() - start
            if took >= SLOW_CALL_S and index >= 0:
                logger.info("GPU {}: reading {} took {:.1f} ms ({})", index, what, took * 1e3, fn)
        return value

    # -- inventory ---------------------------------------------------------------

    def inventory(self) -> NodeInventory:
        with self._lock:
            self._ensure_init()
            n = self._nvml
            driver = self._read(-1, "driver version", "nvmlSystemGetDriverVersion") or ""
            cuda_int = self._read(-1, "cuda version", "nvmlSystemGetCudaDriverVersion")
            cuda = (cuda_int // 1000, (cuda_int % 1000) // 10) if cuda_int else None
            gpus = []
            for i, h in enumerate(self._handles):
                try:
                    if h is None:
                        raise _Lost()
                    info = self._gpu_info(i, h)
                    self._infos[i] = info
                    self._lost.discard(i)
                    if i not in self._gpm_support:
                        self._gpm_probe(i, h)
                except (_Lost, _Unsupported, n.NVMLError) as e:
                    if isinstance(e, _Lost):
                        self._mark_lost(i)
                    elif (i, "identity") not in self._bad_identity:
                        self._bad_identity.add((i, "identity"))
                        logger.error("GPU {}: cannot read its name/UUID ({}); unhealthy", i, e)
                    info = self._infos.get(i) or GpuInfo(
                        index=i,
                        uuid=f"unknown-{i}",
                        name="unknown",
                        memory_total_bytes=0,
                        compute_capability=(0, 0),
                    )
                gpus.append(info)
            return NodeInventory(
                driver_version=_text(driver), cuda_driver_version=cuda, gpus=tuple(gpus)
            )

    def _gpu_info(self, i: int, h: Any) -> GpuInfo:
        n = self._nvml
        name = _text(self._call("nvmlDeviceGetName", h))
        uuid = _text(self._call("nvmlDeviceGetUUID", h))
        mem = self._memory(i, h)
        cc = self._read(i, "compute capability", "nvmlDeviceGetCudaComputeCapability", h)
        pci = self._read(i, "pci info", "nvmlDeviceGetPciInfo", h)
        mig_mode = self._read(i, "mig mode", "nvmlDeviceGetMigMode", h)
        mig_enabled = bool(mig_mode and mig_mode[0] == n.NVML_DEVICE_MIG_ENABLE)
        links = self._fields(i, h, [n.NVML_FI_DEV_NVLINK_LINK_COUNT]).get(
            n.NVML_FI_DEV_NVLINK_LINK_COUNT
        )
        return GpuInfo(
            index=i,
            uuid=uuid,
            name=name,
            memory_total_bytes=int(mem.total) if mem is not None else 0,
            compute_capability=(int(cc[0]), int(cc[1])) if cc else (0, 0),
            pci_bus_id=_text(getattr(pci, "busId", "")) if pci is not None else "",
            mig_capable=mig_mode is not None,
            mig_enabled=mig_enabled,
            mig_devices=self._mig_devices(i, h) if mig_enabled else (),
            nvlink_links=int(links) if links is not None else None,
        )

    def _mig_devices(self, i: int, h: Any) -> tuple[MigDevice, ...]:
        n = self._nvml
        out = []
        count = self._read(i, "mig count", "nvmlDeviceGetMaxMigDeviceCount", h) or 0
        for k in range(count):
            try:
                mh = self._call("nvmlDeviceGetMigDeviceHandleByIndex", h, k)
            except (_Unsupported, n.NVMLError):
                continue  # empty slot
            name = _text(self._read(i, "mig name", "nvmlDeviceGetName", mh) or "")
            mem = self._memory(i, mh)
            # What GFD labels: the MIG device's own SMs, slices, engines and memory size.
            attrs = self._read(i, "mig attributes", "nvmlDeviceGetAttributes_v2", mh)
            total = int(mem.total) if mem is not None else 0
            if attrs is not None and int(attrs.memorySizeMB) > 0:
                total = int(attrs.memorySizeMB) * MIB

            def attr(field: str, attrs: Any = attrs) -> int | None:
                return int(getattr(attrs, field)) if attrs is not None else None

            out.append(
                MigDevice(
                    uuid=_text(self._call("nvmlDeviceGetUUID", mh)),
                    profile=name.rsplit(" ", 1)[-1] if " " in name else name,
                    gpu_instance_id=int(
                        self._read(i, "gi id", "nvmlDeviceGetGpuInstanceId", mh) or 0
                    ),
                    compute_instance_id=int(
                        self._read(i, "ci id", "nvmlDeviceGetComputeInstanceId", mh) or 0
                    ),
                    memory_total_bytes=total,
                    multiprocessors=attr("multiprocessorCount"),
                    gpu_instance_slices=attr("gpuInstanceSliceCount"),
                    compute_instance_slices=attr("computeInstanceSliceCount"),
                    copy_engines=attr("sharedCopyEngineCount"),
                    decoders=attr("sharedDecoderCount"),
                    encoders=attr("sharedEncoderCount"),
                    jpeg_engines=attr("sharedJpegCount"),
                    ofa_engines=attr("sharedOfaCount"),
                )
            )
        return tuple(out)

    # -- samples -----------------------------------------------------------------

    def sample(self) -> tuple[GpuSample, ...]:
        with self._lock:
            self._ensure_init()
            out = []
            for i, h in enumerate(self._handles):
                uuid = self._infos[i].uuid if i in self._infos else ""
                try:
                    if h is None:
                        raise _Lost()
                    out.append(self._sample_one(i, h, uuid))
                except _Lost:
                    self._mark_lost(i)
                    out.append(lost_sample(i, uuid, self._xid_counts(i)))
            return tuple(out)

    def _sample_one(self, i: int, h: Any, uuid: str) -> GpuSample:
        n = self._nvml
        util = self._read(i, "utilization", "nvmlDeviceGetUtilizationRates", h)
        mem = self._memory(i, h)
        temp = self._read(i, "temperature", "nvmlDeviceGetTemperature", h, n.NVML_TEMPERATURE_GPU)
        power_mw = self._read(i, "power", "nvmlDeviceGetPowerUsage", h)
        sm = self._read(i, "sm clock", "nvmlDeviceGetClockInfo", h, n.NVML_CLOCK_SM)
        memclk = self._read(i, "memory clock", "nvmlDeviceGetClockInfo", h, n.NVML_CLOCK_MEM)
        procs = self._read(i, "processes", "nvmlDeviceGetComputeRunningProcesses", h)
        # Volatile (since the driver loaded) ECC totals: two ~3 us calls. Not through
        # nvmlDeviceGetFieldValues, which costs ~4 ms once the energy field is in it.
        sbe = self._read(
            i,
            "ecc corrected",
            "nvmlDeviceGetTotalEccErrors",
            h,
            n.NVML_MEMORY_ERROR_TYPE_CORRECTED,
            n.NVML_VOLATILE_ECC,
        )
        dbe = self._read(
            i,
            "ecc uncorrected",
            "nvmlDeviceGetTotalEccErrors",
            h,
            n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
            n.NVML_VOLATILE_ECC,
        )
        info = self._infos.get(i)
        by_gi = self._gpm_instances(i, h, info.mig_devices if info else ())
        migs = (
            tuple(self._mig_sample(i, m, by_gi.get(m.gpu_instance_id)) for m in info.mig_devices)
            if info
            else ()
        )
        health = self._health_readings(i, h)
        sample = GpuSample(
            index=i,
            uuid=uuid,
            gpu_utilization_ratio=util.gpu / 100.0 if util is not None else None,
            memory_utilization_ratio=util.memory / 100.0 if util is not None else None,
            memory_used_bytes=int(mem.used) if mem is not None else None,
            memory_free_bytes=int(mem.free) if mem is not None else None,
            memory_total_bytes=int(mem.total) if mem is not None else None,
            temperature_celsius=float(temp) if temp is not None else None,
            power_watts=power_mw / 1000.0 if power_mw is not None else None,
            sm_clock_hertz=sm * 1e6 if sm is not None else None,
            memory_clock_hertz=memclk * 1e6 if memclk is not None else None,
            ecc_corrected_errors_total=int(sbe) if sbe is not None else None,
            ecc_uncorrected_errors_total=int(dbe) if dbe is not None else None,
            process_count=len(procs) if procs is not None else None,
            xid_errors_total=self._xid_counts(i),
            mig=migs,
            gpm=self._gpm_read(i, h, None),
            **health,
        )
        return judge(sample)

    def _health_readings(self, i: int, h: Any) -> dict[str, Any]:
        """The cheap health calls of every sample (clock events ~2 us, remapped rows,
        estimated ~10 us: docs/benchmarks.md) and the health counters' newest read."""
        out = dict(self._health.get(i, {}))
        mask = self._read(i, "clock events", "nvmlDeviceGetCurrentClocksEventReasons", h)
        if mask is None and (i, "clock events") in self._unsupported:  # drivers before 535
            mask = self._read(
                i, "clock events (old name)", "nvmlDeviceGetCurrentClocksThrottleReasons", h
            )
        if mask is not None:
            out["clock_events_active"] = signals.clock_events(int(mask))
        rows = self._read(i, "remapped rows", "nvmlDeviceGetRemappedRows", h)
        if rows is not None:
            corr, unc, pending, failure = (int(x) for x in rows[:4])
            out.update(
                remapped_rows_correctable=corr,
                remapped_rows_uncorrectable=unc,
                row_remap_pending=bool(pending),
                row_remap_failed=bool(failure),
            )
        with self._xid_lock:
            changed = i in self._recovery_changed
            self._recovery_changed.discard(i)
        if changed:  # XID 154: the driver's recovery action changed; read it now
            action = self._recovery_action(i, h)
            if action is not None:
                out["recovery_action"] = action
                self._health.setdefault(i, {})["recovery_action"] = action
        return out

    def health_counters(self) -> None:
        """The slower health reads, on `schedules.health` (default 30 s): the recovery
        action and clock-event durations (one field-values call), retired pages (before
        Ampere; absent after the first read elsewhere) and the NVLink error counters (4
        calls per active link: 72 on an H100, too many for every sample)."""
        with self._lock:
            self._ensure_init()
            for i, h in enumerate(self._handles):
                if h is None or i in self._lost:
                    continue
                try:
                    self._health[i] = self._health_counters_one(i, h)
                except _Lost:
                    self._mark_lost(i)

    def _health_counters_one(self, i: int, h: Any) -> dict[str, Any]:
        n = self._nvml
        out: dict[str, Any] = {}
        ids = {
            reason: fid
            for reason, const in signals.CLOCK_EVENT_DURATION_FIELDS.items()
            if (fid := getattr(n, const, None)) is not None
        }
        recovery_id = getattr(n, signals.RECOVERY_ACTION_FIELD, signals.RECOVERY_ACTION_FIELD_ID)
        values = self._health_fields(i, h, [recovery_id, *ids.values()])
        if recovery_id in values:
            out["recovery_action"] = signals.recovery_action_name(int(values[recovery_id]))
        seconds = {r: values[fid] / 1e9 for r, fid in ids.items() if fid in values}  # ns
        if seconds:
            out["clock_event_seconds_total"] = seconds
        sbe = self._read(
            i,
            "retired pages sbe",
            "nvmlDeviceGetRetiredPages",
            h,
            getattr(n, "NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS", 0),
        )
        dbe = self._read(
            i,
            "retired pages dbe",
            "nvmlDeviceGetRetiredPages",
            h,
            getattr(n, "NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR", 1),
        )
        pending = self._read(
            i, "retired pages pending", "nvmlDeviceGetRetiredPagesPendingStatus", h
        )
        if sbe is not None:
            out["retired_pages_single_bit"] = len(sbe)
        if dbe is not None:
            out["retired_pages_double_bit"] = len(dbe)
        if pending is not None:
            out["retired_pages_pending"] = bool(pending)
        links: dict[int, dict[str, int]] = {}
        for link in self._active_links(i, h):
            counts = {}
            for kind, counter in signals.NVLINK_ERROR_COUNTERS.items():
                v = self._read(i, f"nvlink {link} {kind}", NVLINK_CALL, h, link, counter)
                if v is not None:
                    counts[kind] = int(v)
            if counts:
                links[link] = counts
        if links:
            out["nvlink_errors_total"] = links
        return out

    def _recovery_action(self, i: int, h: Any) -> str | None:
        fid = getattr(self._nvml, signals.RECOVERY_ACTION_FIELD, signals.RECOVERY_ACTION_FIELD_ID)
        v = self._health_fields(i, h, [fid]).get(fid)
        return signals.recovery_action_name(int(v)) if v is not None else None

    def _health_fields(self, i: int, h: Any, ids: list[int]) -> dict[int, float]:
        """nvmlDeviceGetFieldValues for health fields: a field the GPU does not support
        is not asked again (absent, never 0); never with the energy field (~4 ms)."""
        n = self._nvml
        ask = [f for f in ids if (i, f) not in self._unsupported_fields]
        if not ask or (i, "health fields") in self._unsupported:
            return {}
        values = self._read(i, "health fields", "nvmlDeviceGetFieldValues", h, ask)
        out: dict[int, float] = {}
        for v in values or ():
            fid = int(v.fieldId)
            if v.nvmlReturn == n.NVML_ERROR_GPU_IS_LOST:
                raise _Lost()
            if v.nvmlReturn == n.NVML_SUCCESS:
                out[fid] = _field_value(n, v)
            elif v.nvmlReturn == n.NVML_ERROR_NOT_SUPPORTED:
                self._unsupported_fields.add((i, fid))
        return out

    def _active_links(self, i: int, h: Any) -> tuple[int, ...]:
        """The NVLink links that are up, probed once per GPU (up to the inventory's link
        count, else NVML_NVLINK_MAX_LINKS)."""
        known = self._nvlinks.get(i)
        if known is not None:
            return known
        n = self._nvml
        info = self._infos.get(i)
        top = getattr(n, "NVML_NVLINK_MAX_LINKS", signals.NVLINK_MAX_LINKS)
        if info is not None and info.nvlink_links is not None:
            top = min(top, info.nvlink_links)
        up = []
        for link in range(top):
            try:
                state = self._call("nvmlDeviceGetNvLinkState", h, link)
            except _Unsupported:
                break  # no NVLink on this GPU
            except n.NVMLError:
                continue  # this link does not exist
            if int(state) == getattr(n, "NVML_FEATURE_ENABLED", 1):
                up.append(link)
        self._nvlinks[i] = tuple(up)
        if up:
            logger.info("GPU {}: {} NVLink links up; reading their error counters", i, len(up))
        return self._nvlinks[i]

    def energy(self) -> dict[int, float | None]:
        """Each GPU's energy counter in joules since the driver loaded (None: not
        supported, lost or failing). ~3.9 ms per GPU on an H100: read on the energy
        schedule, not with every sample."""
        with self._lock:
            self._ensure_init()
            out: dict[int, float | None] = {}
            for i, h in enumerate(self._handles):
                if h is None or i in self._lost:
                    out[i] = None
                    continue
                try:
                    mj = self._read(i, "energy", "nvmlDeviceGetTotalEnergyConsumption", h)
                except _Lost:
                    self._mark_lost(i)
                    mj = None
                out[i] = mj / 1000.0 if mj is not None else None
            return out

    def _mig_sample(self, i: int, m: MigDevice, reading: GpmReading | None) -> MigSample:
        n = self._nvml
        try:
            mh = self._call("nvmlDeviceGetHandleByUUID", m.uuid.encode())
        except (_Unsupported, n.NVMLError):
            return MigSample(uuid=m.uuid, gpm=reading)
        mem = self._memory(i, mh)
        return MigSample(
            uuid=m.uuid,
            memory_used_bytes=int(mem.used) if mem is not None else None,
            memory_total_bytes=int(mem.total) if mem is not None else None,
            gpm=reading,
        )

    # -- GPM (Hopper+) -------------------------------------------------------------

    def _gpm_probe(self, i: int, h: Any) -> None:
        """Whether GPU i has GPM (nvmlGpmQueryDeviceSupport), asked once; the cost of
        each GPM call's first use is in `first_read_s` and logged at debug."""
        start = _timer()
        try:
            ok = bool(self._call("nvmlGpmQueryDeviceSupport", h).isSupportedDevice)
        except (_Unsupported, self._nvml.NVMLError):  # a driver before GPM, or no support
            ok = False
        self._gpm_support[i] = ok
        self._took(i, "gpm support", start)
        if ok:
            logger.info("GPU {}: GPM supported; reading SM, tensor and DRAM activity", i)

    def _took(self, i: int, what: str, start: float) -> None:
        if (i, what) not in self.first_read_s:
            took = self.first_read_s[(i, what)] = _timer() - start
            logger.debug("GPU {}: the first {} cost {:.3f} ms", i, what, took * 1e3)

    def _gpm_table(self) -> dict[int, tuple[str, str]]:
        """GPM metric id -> (kind, name): a ratio we export, or a (link, direction) rate
        in MiB/s. Tensor is ANY_TENSOR (HMMA + IMMA + DMMA), as DCGM's PIPE_TENSOR_ACTIVE."""
        if self._gpm_ids is None:
            n = self._nvml
            self._gpm_ids = {
                n.NVML_GPM_METRIC_SM_UTIL: ("ratio", "sm_active_ratio"),
                n.NVML_GPM_METRIC_SM_OCCUPANCY: ("ratio", "sm_occupancy_ratio"),
                n.NVML_GPM_METRIC_ANY_TENSOR_UTIL: ("ratio", "tensor_active_ratio"),
                n.NVML_GPM_METRIC_DRAM_BW_UTIL: ("ratio", "dram_active_ratio"),
                n.NVML_GPM_METRIC_FP64_UTIL: ("ratio", "fp64_active_ratio"),
                n.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC: ("nvlink", "tx"),
                n.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC: ("nvlink", "rx"),
                n.NVML_GPM_METRIC_PCIE_TX_PER_SEC: ("pcie", "tx"),
                n.NVML_GPM_METRIC_PCIE_RX_PER_SEC: ("pcie", "rx"),
            }
        return self._gpm_ids

    def _gpm_instances(
        self, i: int, h: Any, devices: tuple[MigDevice, ...]
    ) -> dict[int, GpmReading | None]:
        """Per GPU instance of a MIG GPU with GPM, its reading; pairs of GPU instances
        that are gone (a new MIG layout) are freed."""
        gis = {m.gpu_instance_id for m in devices} if i not in self._gpm_no_mig else set()
        for key in [k for k in self._gpm if k[0] == i and k[1] is not None and k[1] not in gis]:
            self._gpm_free(i, key[1])
        return {gi: self._gpm_read(i, h, gi) for gi in sorted(gis)}

    def _gpm_read(self, i: int, h: Any, gi: int | None) -> GpmReading | None:
        """This poll's GPM sample paired with the previous poll's. None on a GPU without
        GPM (NOT_SUPPORTED turns it off), on the first poll, and for this poll only when
        a sample or the metrics fail (logged once); _Lost propagates."""
        if not self._gpm_support.get(i):
            return None
        n = self._nvml
        pair = self._gpm.get((i, gi))
        try:
            if pair is None:
                pair = self._gpm[(i, gi)] = self._gpm_alloc()
            start = _timer()
            if gi is None:
                self._call("nvmlGpmSampleGet", h, pair.cur)
            else:
                self._call("nvmlGpmMigSampleGet", h, gi, pair.cur)
            self._took(i, "gpm sample" if gi is None else "gpm mig sample", start)
            now, then = _clock(), pair.at
            pair.prev, pair.cur, pair.at = pair.cur, pair.prev, now  # `prev` is this one
            if then is None:
                return None  # the first poll: no pair yet
            start = _timer()
            ratios, rates = self._gpm_metrics(pair)
            self._took(i, "gpm metrics", start)
        except _Unsupported:
            where = "" if gi is None else f" on GPU instance {gi}"
            logger.info("GPU {}: GPM is not supported{}; not read again", i, where)
            if gi is None:
                self._gpm_support[i] = False
                self._gpm_free(i)
            else:
                self._gpm_no_mig.add(i)
                self._gpm_free(i, gi)
            return None
        except n.NVMLError as e:  # e.g. a pair that does not span an interval
            if self._warn_once.allow(("gpm", i, gi)):
                logger.warning("GPU {}: GPM read failed: {}; absent this poll", i, e)
            return None
        pair.counters.add(rates, now - then)
        return gpm.reading(ratios, pair.counters)

    def _gpm_metrics(self, pair: _GpmPair) -> tuple[dict[str, float], dict[tuple[str, str], float]]:
        """nvmlGpmMetricsGet over (previous, this) sample: ratios and MiB/s rates. A
        metric NVML says is unsupported (NVLink on a PCIe card) is not asked again."""
        n = self._nvml
        table = self._gpm_table()
        ids = [m for m in table if m not in pair.skip]
        mg = pair.metrics
        mg.version = n.NVML_GPM_METRICS_GET_VERSION
        mg.numMetrics = len(ids)
        mg.sample1, mg.sample2 = pair.cur, pair.prev  # the older sample first
        for k, mid in enumerate(ids):
            mg.metrics[k].metricId = mid
        self._call("nvmlGpmMetricsGet", mg)
        ratios: dict[str, float] = {}
        rates: dict[tuple[str, str], float] = {}
        for k in range(len(ids)):
            m = mg.metrics[k]
            mid, ret = int(m.metricId), int(m.nvmlReturn)
            if ret == n.NVML_ERROR_GPU_IS_LOST:
                raise _Lost()
            if ret == n.NVML_ERROR_NOT_SUPPORTED:
                pair.skip.add(mid)
            if ret != n.NVML_SUCCESS or mid not in table:
                continue
            kind, name = table[mid]
            if kind == "ratio":
                ratios[name] = gpm.ratio(m.value)
            else:
                rates[(kind, name)] = float(m.value)
        return ratios, rates

    def _gpm_alloc(self) -> _GpmPair:
        first = self._call("nvmlGpmSampleAlloc")
        try:
            second = self._call("nvmlGpmSampleAlloc")
        except BaseException:
            self._gpm_release(first)
            raise
        return _GpmPair(prev=first, cur=second, metrics=self._nvml.c_nvmlGpmMetricsGet_t())

    def _gpm_free(self, i: int, gi: int | None = None) -> None:
        """Free GPU i's GPM sample buffers: one GPU instance's, or (None) all of them."""
        for key in [k for k in self._gpm if k[0] == i and (gi is None or k[1] == gi)]:
            pair = self._gpm.pop(key)
            self._gpm_release(pair.prev)
            self._gpm_release(pair.cur)

    def _gpm_release(self, sample: Any) -> None:
        try:
            self._call("nvmlGpmSampleFree", sample)
        except (_Unsupported, _Lost, self._nvml.NVMLError) as e:
            logger.debug("nvmlGpmSampleFree: {}", e)

    def _memory(self, i: int, h: Any) -> Any:
        """Memory info, preferring _v2 (reserved memory excluded), probed once."""
        n = self._nvml
        if self._memory_v2 is not False:
            try:
                mem = self._call("nvmlDeviceGetMemoryInfo", h, n.nvmlMemory_v2)
                self._memory_v2 = True
                return mem
            except (_Unsupported, TypeError, n.NVMLError):
                if self._memory_v2 is None:
                    logger.info("nvmlDeviceGetMemoryInfo_v2 unavailable; using v1")
                self._memory_v2 = False
        return self._read(i, "memory", "nvmlDeviceGetMemoryInfo", h)

    def _fields(self, i: int, h: Any, ids: list[int]) -> dict[int, float]:
        """Batched reads through nvmlDeviceGetFieldValues; absent ids are unsupported."""
        n = self._nvml
        if self._field_values is False:
            return {}
        try:
            values = self._call("nvmlDeviceGetFieldValues", h, ids)
        except _Unsupported:
            if self._field_values is None:
                logger.info("nvmlDeviceGetFieldValues unavailable; the NVLink link count is absent")
            self._field_values = False
            return {}
        except n.NVMLError as e:
            if self._warn_once.allow(("field values", i)):
                logger.warning("GPU {}: nvmlDeviceGetFieldValues failed: {}", i, e)
            return {}
        self._field_values = True
        out: dict[int, float] = {}
        for v in values:
            if v.nvmlReturn == n.NVML_ERROR_GPU_IS_LOST:
                raise _Lost()
            if v.nvmlReturn != n.NVML_SUCCESS:
                continue
            out[int(v.fieldId)] = _field_value(n, v)
        return out

    # -- health and XID events ---------------------------------------------------

    def _mark_lost(self, i: int) -> None:
        self._gpm_free(i)  # a lost GPU's samples are stale; its buffers go back
        if i not in self._lost:
            self._lost.add(i)
            # The ERROR line is healthlog's (one per episode, for every backend).
            logger.debug("GPU {} is lost (fell off the bus); other GPUs carry on", i)

    def _xid_loop(self) -> None:
        n = self._nvml
        try:
            evset = n.nvmlEventSetCreate()
        except n.NVMLError as e:
            logger.warning("XID events unavailable: {}", e)
            return
        by_handle: dict[int, int] = {}
        for i, h in enumerate(self._handles):
            try:
                n.nvmlDeviceRegisterEvents(h, n.nvmlEventTypeXidCriticalError, evset)
                by_handle[_handle_key(h)] = i
            except n.NVMLError as e:
                logger.warning("GPU {}: XID events unavailable: {}", i, e)
        while not self._stop.is_set():
            try:
                data = n.nvmlEventSetWait(evset, 1000)
            except n.NVMLError as e:
                if getattr(e, "value", None) == n.NVML_ERROR_TIMEOUT:
                    continue
                logger.warning("XID event wait failed: {}; retrying", e)
                self._stop.wait(1.0)
                continue
            i = by_handle.get(_handle_key(data.device), -1)
            xid = int(data.eventData)
            self.record_xid(i, xid)
        with contextlib.suppress(n.NVMLError):
            n.nvmlEventSetFree(evset)

    def record_xid(self, index: int, xid: int) -> None:
        """Count one XID on a GPU (called by the event thread)."""
        with self._xid_lock:
            counts = self._xids.setdefault(index, {})
            counts[xid] = counts.get(xid, 0) + 1
            if is_critical_xid(xid):
                self._first_critical_xid.setdefault(index, xid)
            if xid == 154:  # the recovery action changed: the next sample reads it
                self._recovery_changed.add(index)
        # Per event at DEBUG: healthlog writes one line per burst from the counters.
        logger.debug("GPU {}: XID {} reported by the driver", index, xid)

    def _xid_counts(self, index: int) -> dict[int, int]:
        with self._xid_lock:
            return dict(self._xids.get(index, {}))


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _handle_key(h: Any) -> int:
    """A stable key for an NVML device handle (a ctypes pointer or a test object)."""
    contents = getattr(h, "contents", None)
    if contents is not None:
        try:
            import ctypes

            return ctypes.addressof(contents)
        except TypeError:
            pass
    return id(h)


def _field_value(n: ModuleType, v: Any) -> float:
    t = v.valueType
    if t == n.NVML_VALUE_TYPE_DOUBLE:
        return float(v.value.dVal)
    if t == n.NVML_VALUE_TYPE_UNSIGNED_INT:
        return float(v.value.uiVal)
    if t == n.NVML_VALUE_TYPE_UNSIGNED_LONG:
        return float(v.value.ulVal)
    if t == n.NVML_VALUE_TYPE_SIGNED_LONG_LONG:
        return float(v.value.sllVal)
    if t == n.NVML_VALUE_TYPE_SIGNED_INT:
        return float(v.value.siVal)
    return float(v.value.ullVal)
