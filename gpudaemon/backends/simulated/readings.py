"""The readings model: each simulated GPU's state (`SimGpu`), its sample (utilization by
pattern, memory, power, clocks, ECC, the health signals, GPM), and what the NVML calls
the real backend makes for it would cost (charged by the backend)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

from gpudaemon.backends import gpm
from gpudaemon.backends.base import HEALTH_CALLS, NVLINK_CALL, RETIRED_PAGES_CALLS, lost_sample
from gpudaemon.backends.simulated.faults import FaultSpec
from gpudaemon.backends.simulated.profile import GpuSpec, _ampere, has_gpm
from gpudaemon.health import signals
from gpudaemon.health.verdict import judge
from gpudaemon.model import MIB, GpmReading, GpuInfo, GpuSample, MigSample


def _cost_s(spec: GpuSpec, calls: tuple[str, ...]) -> float:
    return sum(spec.nvml_latency_us.get(c, 0.0) for c in calls) / 1e6


def _health_cost_s(spec: GpuSpec) -> float:
    """What NvmlBackend.health_counters costs this GPU: the health fields, the retired
    pages before Ampere, and 4 error counters per NVLink link."""
    calls = HEALTH_CALLS + (() if _ampere(spec) else RETIRED_PAGES_CALLS)
    links = spec.nvlink_links or 0
    nvlink = links * len(signals.NVLINK_ERROR_COUNTERS) * spec.nvml_latency_us.get(NVLINK_CALL, 0.0)
    return _cost_s(spec, calls) + nvlink / 1e6


@dataclass
class SimGpu:
    info: GpuInfo
    spec: GpuSpec
    faults: list[FaultSpec]
    energy_joules: float = 0.0
    walk: float = 0.5
    xids: dict[int, int] = field(default_factory=dict)
    ecc_corrected: int = 0
    ecc_uncorrected: int = 0
    lost: bool = False
    first_critical_xid: int | None = None
    # One stream per GPU, seeded once: the n-th sample of a GPU is the same for the same
    # seed, and seeding a generator per sample cost more than the rest of the sample.
    rng: random.Random = field(default_factory=random.Random)
    sample_cost_s: float = 0.0  # what NVML would take for this GPU's sample
    overhead_s: float = 0.0  # ... and the real backend's own work around those calls
    mig_generation: int = 0  # how many times the MIG layout was changed
    energy_cost_s: float = 0.0  # ... and for its energy read
    health_cost_s: float = 0.0  # ... and for its health counters' read
    # Health signals (health/signals.py names).
    remapped_correctable: int = 0
    remapped_uncorrectable: int = 0
    remap_pending: bool = False
    remap_failed: bool = False
    recovery_action: str = "none"
    nvlink: dict[int, dict[str, int]] = field(default_factory=dict)
    nvlink_adders: list[FaultSpec] = field(default_factory=list)  # fired nvlink_errors
    clock_events: frozenset[str] = frozenset()
    persistent: list[FaultSpec] = field(default_factory=list)  # fired; a reset re-fires them
    clock_seconds: dict[str, float] = field(default_factory=dict)
    # GPM: whether a previous poll's sample exists (the first poll has no value), the
    # cost of the GPU's and of each GPU instance's GPM calls, the byte counters.
    gpm_primed: bool = False
    gpm_cost_s: float = 0.0
    gpm_mig_cost_s: float = 0.0
    gpm_counters: gpm.Counters = field(default_factory=gpm.Counters)

    def cost_s(self) -> float:
        """What a real sample of this GPU would take: its NVML calls, GPM included, and
        the backend's own work around them."""
        if not has_gpm(self.spec):
            return self.sample_cost_s + self.overhead_s
        return (
            self.sample_cost_s
            + self.overhead_s
            + self.gpm_cost_s
            + self.gpm_mig_cost_s * len(self.info.mig_devices)
        )


def sample_gpu(g: SimGpu, elapsed: float, dt: float) -> GpuSample:
    """One GPU's sample, its faults fired: a pure function of its state, its seeded
    stream, the time since the start and since the last sample."""
    info, spec = g.info, g.spec
    xids = dict(g.xids)
    if g.lost:
        return lost_sample(info.index, info.uuid, xids)
    health = health_signals(g, dt)
    rng = g.rng
    util = utilization(g, rng, elapsed)
    mean = 0.0 if spec.utilization.pattern == "idle" else spec.utilization.mean
    total = info.memory_total_bytes
    mem_frac = min(0.95, max(0.0, 0.005 + 0.85 * mean + rng.gauss(0.0, 0.005)))
    used = int(total * mem_frac) // MIB * MIB
    power = spec.power_max_watts * (0.1 + 0.85 * util) + rng.gauss(0.0, 1.0)
    g.energy_joules += power * dt
    busy = util > 0.05
    util = round(util, 4)
    reading = gpm_reading(g, util, dt)
    migs = tuple(
        MigSample(
            uuid=m.uuid,
            memory_total_bytes=m.memory_total_bytes,
            memory_used_bytes=int(m.memory_total_bytes * mem_frac) // MIB * MIB,
            gpm=_mig_gpm(reading, k),
        )
        for k, m in enumerate(info.mig_devices)
    )
    sample = GpuSample(
        index=info.index,
        uuid=info.uuid,
        gpu_utilization_ratio=util,
        memory_utilization_ratio=round(min(1.0, util * 0.6), 4),
        memory_used_bytes=used,
        memory_free_bytes=total - used,
        memory_total_bytes=total,
        temperature_celsius=round(30.0 + 50.0 * util + rng.gauss(0.0, 0.5), 1),
        power_watts=round(power, 3),
        sm_clock_hertz=(spec.sm_clock_max_mhz if busy else 345.0) * 1e6,
        memory_clock_hertz=spec.memory_clock_mhz * 1e6,
        ecc_corrected_errors_total=g.ecc_corrected if spec.ecc else None,
        ecc_uncorrected_errors_total=g.ecc_uncorrected if spec.ecc else None,
        process_count=(1 + info.index % 2) if busy else 0,
        xid_errors_total=xids,
        mig=migs,
        gpm=reading,
        **health,
    )
    return judge(sample)


def health_signals(g: SimGpu, dt: float) -> dict[str, Any]:
    """The health readings a real GPU of this spec gives (absent where it gives none)."""
    spec = g.spec
    for f in g.nvlink_adders:  # counts added per poll
        c = g.nvlink[f.link]
        c["crc_flit"] += f.crc_flit
        c["crc_data"] += f.crc_data
        c["replay"] += f.replay
        c["recovery"] += f.recovery
    for reason in g.clock_events & g.clock_seconds.keys():
        g.clock_seconds[reason] += dt
    out: dict[str, Any] = {
        "recovery_action": g.recovery_action,
        "clock_events_active": g.clock_events,
        "clock_event_seconds_total": {k: round(v, 3) for k, v in g.clock_seconds.items()},
        "nvlink_errors_total": {link: dict(c) for link, c in g.nvlink.items()},
    }
    if spec.ecc and _ampere(spec):
        out.update(
            remapped_rows_correctable=g.remapped_correctable,
            remapped_rows_uncorrectable=g.remapped_uncorrectable,
            row_remap_pending=g.remap_pending,
            row_remap_failed=g.remap_failed,
        )
    elif spec.ecc:  # before Ampere: page retirement instead of row remapping
        out.update(
            retired_pages_single_bit=0, retired_pages_double_bit=0, retired_pages_pending=False
        )
    return out


def utilization(g: SimGpu, rng: random.Random, elapsed: float) -> float:
    u = g.spec.utilization
    noise = rng.gauss(0.0, u.noise) if u.noise else 0.0
    if u.pattern == "idle":
        value = abs(noise) * 0.2
    elif u.pattern == "busy":
        value = 0.97 + noise
    elif u.pattern == "sine":
        value = u.mean + u.amplitude * math.sin(2 * math.pi * elapsed / u.period_s) + noise
    elif u.pattern == "random-walk":
        g.walk += 0.2 * (u.mean - g.walk) + noise
        g.walk = min(1.0, max(0.0, g.walk))
        value = g.walk
    else:
        value = u.mean + noise
    return min(1.0, max(0.0, value))


def gpm_reading(g: SimGpu, util: float, dt: float) -> GpmReading | None:
    """GPM readings that fit the utilization: SM activity is at most utilization (a
    busy GPU seldom fills every SM), tensor activity is within SM activity, DRAM
    follows memory activity; NVLink and PCIe bytes grow with load. None without GPM
    and on the first poll, as NVML gives (a pair needs two samples)."""
    if not has_gpm(g.spec):
        return None
    if not g.gpm_primed:
        g.gpm_primed = True
        return None
    sm = _floor(util * (0.55 + 0.4 * util))
    links = g.spec.nvlink_links or 0
    rates = {("pcie", "tx"): 2048.0 * util, ("pcie", "rx"): 3072.0 * util}
    if links:  # MiB/s: ~1 GiB/s per link per unit of load, a little less read
        rates |= {
            ("nvlink", "tx"): 1024.0 * links * util,
            ("nvlink", "rx"): 900.0 * links * util,
        }
    g.gpm_counters.add(rates, dt)
    ratios = {
        "sm_active_ratio": sm,
        "sm_occupancy_ratio": _floor(sm * 0.5),
        "tensor_active_ratio": _floor(sm * 0.7),
        "dram_active_ratio": _floor(min(1.0, util * 0.6 * 0.9)),
        "fp64_active_ratio": _floor(sm * 0.02),
    }
    return gpm.reading(ratios, g.gpm_counters)


def _floor(v: float) -> float:
    """Rounded down to 4 places, so a reading derived from another never passes it."""
    return math.floor(v * 1e4) / 1e4


def _mig_gpm(r: GpmReading | None, k: int) -> GpmReading | None:
    """A GPU instance's share of the GPU's activity: its own ratios, each at most the
    GPU's (instance k is a little less busy than k-1); no byte counters per instance."""
    if r is None:
        return None
    f = 1.0 - 0.1 * (k % 4)

    def part(v: float | None) -> float | None:
        return None if v is None else _floor(v * f)

    return GpmReading(
        sm_active_ratio=part(r.sm_active_ratio),
        sm_occupancy_ratio=part(r.sm_occupancy_ratio),
        tensor_active_ratio=part(r.tensor_active_ratio),
        dram_active_ratio=part(r.dram_active_ratio),
        fp64_active_ratio=part(r.fp64_active_ratio),
    )
