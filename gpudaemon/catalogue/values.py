"""How each catalogue row reads its values from a sample: ECC by type, XID by code,
the health signals, the GPM readings, the info labels and the MIG figures."""

from __future__ import annotations

from collections.abc import Iterable

from gpudaemon.catalogue.series import (
    GpuValues,
    MigValue,
    Number,
)
from gpudaemon.health.signals import CLOCK_EVENT_REASONS, RECOVERY_ACTION_NAMES
from gpudaemon.health.verdict import ACTIONS, STATES
from gpudaemon.health.xid import APPLICATION_XIDS, XIDS
from gpudaemon.model import GpuInfo, GpuSample, MigDevice, MigSample, NodeInventory


def _ecc(s: GpuSample) -> Iterable[tuple[str, Number]]:
    if s.ecc_corrected_errors_total is not None:
        yield "corrected", s.ecc_corrected_errors_total
    if s.ecc_uncorrected_errors_total is not None:
        yield "uncorrected", s.ecc_uncorrected_errors_total


# XID codes that keep their own `xid` label value: those NVIDIA's catalog names in our
# table, and the application set. Any other code (a driver's or a forged one) is summed
# under "other": the driver may report any 32-bit code, and each distinct value would
# be one more series on every scrape and in Prometheus, for ever.
KNOWN_XIDS = frozenset(XIDS) | APPLICATION_XIDS
OTHER_XID = "other"


def _xid(s: GpuSample) -> Iterable[tuple[str, Number]]:
    out: list[tuple[str, Number]] = []
    other: Number | None = None
    for code, n in sorted(s.xid_errors_total.items()):
        if code in KNOWN_XIDS:
            out.append((str(code), n))
        else:
            other = n if other is None else other + n
    if other is not None:
        out.append((OTHER_XID, other))
    return out


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
