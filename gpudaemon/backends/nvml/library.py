"""NVML as one backend holds it: loading pynvml, init (counting the GPUs, starting the
XID event thread) and shutdown, the call wrapper that maps NVML's errors ("not supported"
-> None, GPU lost -> isolated), the first-read probe, the GPM sample buffers and the XID
counts. The readings are in backend.py, healthreads.py and gpmreads.py."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, cast

from loguru import logger

from gpudaemon.backends import gpm
from gpudaemon.backends.base import host_boot_id, is_critical_xid
from gpudaemon.backends.xidevents import XidListener, XidListeners, xid_event_loop
from gpudaemon.errors import BackendError, NvmlUnavailableError
from gpudaemon.logsetup import LogLimiter
from gpudaemon.model import GpuInfo
from gpudaemon.remediation import nvsmi

# A first read at least this slow is logged (the energy counter: ~3.9 ms on an H100).
SLOW_CALL_S = 0.001
_timer = time.perf_counter  # the probe's clock (a test replaces it)


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


class NvmlLibrary:
    """The state and the NVML plumbing the readings share (the readings' mixins and
    NvmlBackend build on it). `nvml` may be a stand-in module with the same API (tests)."""

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
        self._listeners = XidListeners()

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
        self._stop_events()
        with self._lock:
            self._shutdown()

    def _stop_events(self) -> None:
        self._stop.set()
        if self._xid_thread is not None:
            self._xid_thread.join(timeout=3)

    def _shutdown(self) -> None:
        """Let go of NVML (under the lock): the GPM buffers, then nvmlShutdown."""
        if self._initialised:
            for i in {k[0] for k in self._gpm}:
                self._gpm_free(i)
            try:
                self._nvml.nvmlShutdown()
            except self._nvml.NVMLError as e:
                logger.debug("nvmlShutdown: {}", e)
            self._initialised = False

    def reset_gpu(self, index: int, tool: str, timeout_s: float) -> nvsmi.ToolResult:
        """Run the reset with NVML shut down: to the tool, an open NVML client (the
        event set above all) uses the GPU. Polling of every GPU waits meanwhile; NVML
        comes back with the next call (the event thread with it). The GPU's own counts
        (XIDs seen, lost, the health fields) start again after a good reset."""
        info = self._infos.get(index)
        if info is None:
            return nvsmi.ToolResult(False, False, None, f"GPU {index} is not in the inventory")
        self._stop_events()
        with self._lock:
            self._shutdown()
            self._xid_thread, self._stop = None, threading.Event()
            result = nvsmi.reset(tool, info.uuid, timeout_s)
            if result.ok:
                with self._xid_lock:
                    self._xids.pop(index, None)
                    self._first_critical_xid.pop(index, None)
                self._lost.discard(index)
                self._health.pop(index, None)
                self._recovery_changed.discard(index)
                self._gpm_support.pop(index, None)
        return result

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

    def _took(self, i: int, what: str, start: float) -> None:
        if (i, what) not in self.first_read_s:
            took = self.first_read_s[(i, what)] = _timer() - start
            logger.debug("GPU {}: the first {} cost {:.3f} ms", i, what, took * 1e3)

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

    # -- health and XID events ---------------------------------------------------

    def _mark_lost(self, i: int) -> None:
        self._gpm_free(i)  # a lost GPU's samples are stale; its buffers go back
        if i not in self._lost:
            self._lost.add(i)
            # The ERROR line is healthlog's (one per episode, for every backend).
            logger.debug("GPU {} is lost (fell off the bus); other GPUs carry on", i)

    def _xid_loop(self) -> None:
        xid_event_loop(self._nvml, self._handles, self._stop, self.record_xid)

    def subscribe(self, listener: XidListener) -> None:
        """Tell `listener(index, xid)` of every XID as the event thread counts it: the
        agent's quarantine path wakes on it instead of waiting for the next poll."""
        self._listeners.add(listener)

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
        self._listeners.tell(index, xid)

    def _xid_counts(self, index: int) -> dict[int, int]:
        with self._xid_lock:
            return dict(self._xids.get(index, {}))


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


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
