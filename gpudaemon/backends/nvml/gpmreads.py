"""GPM (Hopper+; issue 33): support probed once per GPU, one GPM sample per poll paired
with the previous poll's, per GPU and (MIG on) per GPU instance; the metrics read through
nvmlGpmMetricsGet. The arithmetic is in backends/gpm.py."""

from __future__ import annotations

import time
from typing import Any

from loguru import logger

from gpudaemon.backends import gpm
from gpudaemon.backends.nvml import library
from gpudaemon.backends.nvml.library import NvmlLibrary, _GpmPair, _Lost, _Unsupported
from gpudaemon.model import GpmReading, MigDevice

_clock = time.monotonic  # the GPM interval's clock (a test replaces it)


class GpmReads(NvmlLibrary):
    """The GPM reads, mixed into NvmlBackend."""

    def _gpm_probe(self, i: int, h: Any) -> None:
        """Whether GPU i has GPM (nvmlGpmQueryDeviceSupport), asked once; the cost of
        each GPM call's first use is in `first_read_s` and logged at debug."""
        start = library._timer()
        try:
            ok = bool(self._call("nvmlGpmQueryDeviceSupport", h).isSupportedDevice)
        except (_Unsupported, self._nvml.NVMLError):  # a driver before GPM, or no support
            ok = False
        self._gpm_support[i] = ok
        self._took(i, "gpm support", start)
        if ok:
            logger.info("GPU {}: GPM supported; reading SM, tensor and DRAM activity", i)

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
            start = library._timer()
            if gi is None:
                self._call("nvmlGpmSampleGet", h, pair.cur)
            else:
                self._call("nvmlGpmMigSampleGet", h, gi, pair.cur)
            self._took(i, "gpm sample" if gi is None else "gpm mig sample", start)
            now, then = _clock(), pair.at
            pair.prev, pair.cur, pair.at = pair.cur, pair.prev, now  # `prev` is this one
            if then is None:
                return None  # the first poll: no pair yet
            start = library._timer()
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
