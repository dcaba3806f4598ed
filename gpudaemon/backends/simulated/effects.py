"""What a fault does to a simulated GPU's state when it fires (`fire_faults`), an XID
counted as NVML's event thread counts it (`record_xid`), and what a GPU reset undoes
(`reset`)."""

from __future__ import annotations

from collections.abc import Callable

from gpudaemon.backends.base import is_critical_xid
from gpudaemon.backends.simulated.readings import SimGpu


def record_xid(g: SimGpu, xid: int, count: int = 1) -> None:
    """Count XIDs on a GPU, as NVML's event thread does (NvmlLibrary.record_xid)."""
    g.xids[xid] = g.xids.get(xid, 0) + count
    if is_critical_xid(xid) and g.first_critical_xid is None:
        g.first_critical_xid = xid


def fire_faults(
    g: SimGpu,
    elapsed: float,
    polls: int,
    post_xid: Callable[[int, int, int], None] | None = None,
) -> None:
    """Apply the faults whose time (`after_s`) and poll (`after_polls`) have come;
    the others stay queued. With `post_xid(index, xid, count)` (the event thread
    runs), an XID fault becomes driver events instead of being counted here."""
    pending = []
    for f in g.faults:
        if elapsed < f.after_s or polls <= f.after_polls:
            pending.append(f)
            continue
        if f.persistent:
            g.persistent.append(f)
        if f.kind == "lost":
            g.lost = True
        elif f.kind == "xid":
            if post_xid is not None:
                post_xid(g.info.index, f.xid, f.count)
            else:
                record_xid(g, f.xid, f.count)
        elif f.kind == "ecc":
            g.ecc_corrected += f.corrected
            g.ecc_uncorrected += f.uncorrected
        elif f.kind == "row_remap":
            g.remapped_correctable += f.correctable
            g.remapped_uncorrectable += f.uncorrectable
            if "pending" in f.model_fields_set:
                g.remap_pending = f.pending
            if "failure" in f.model_fields_set:
                g.remap_failed = f.failure
        elif f.kind == "recovery_action":
            g.recovery_action = f.action
        elif f.kind == "nvlink_errors":
            g.nvlink_adders.append(f)
        else:
            g.clock_events = frozenset(f.reasons)
    g.faults = pending


def reset(g: SimGpu) -> None:
    """What `nvidia-smi --gpu-reset` does to the GPU's state: the volatile XID and ECC
    counts start again, a pending row remap takes effect (one more remapped row), the
    driver's recovery actions that a reset answers end. A remap failure stays, and so
    does every persistent fault: it is queued to fire again at once. (A lost GPU does
    not reset at all: the caller refuses it.)"""
    g.xids.clear()
    g.first_critical_xid = None
    g.ecc_corrected = g.ecc_uncorrected = 0
    if g.remap_pending:
        g.remap_pending = False
        g.remapped_uncorrectable += 1
    if g.recovery_action in ("gpu_reset", "drain_and_reset"):
        g.recovery_action = "none"
    g.gpm_primed = False  # the GPM buffers start over
    again = [f.model_copy(update={"after_s": 0.0, "after_polls": 0}) for f in g.persistent]
    g.persistent = []
    g.faults.extend(again)
