"""NvmlBackend: the Backend over NVML: the inventory (identity, MIG devices, NVLink
link count), each GPU's sample (utilization, memory, temperature, power, clocks, ECC,
processes, with the health and GPM readings merged in) and the energy counter."""

from __future__ import annotations

from typing import Any

from loguru import logger

from gpudaemon.backends.base import lost_sample
from gpudaemon.backends.nvml.gpmreads import GpmReads
from gpudaemon.backends.nvml.healthreads import HealthReads
from gpudaemon.backends.nvml.library import _field_value, _Lost, _text, _Unsupported
from gpudaemon.health.verdict import judge
from gpudaemon.model import (
    MIB,
    GpmReading,
    GpuInfo,
    GpuSample,
    MigDevice,
    MigSample,
    NodeInventory,
)


class NvmlBackend(HealthReads, GpmReads):
    """Backend over NVML. `nvml` may be a stand-in module with the same API (tests)."""

    name = "nvml"

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
