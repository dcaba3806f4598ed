"""The simulated fault kinds: their fields, what each needs of the GPU (as a real one
would give the signal), and what each does to the GPU's state when it fires."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BeforeValidator, Field, model_validator

from gpudaemon.backends.base import is_critical_xid
from gpudaemon.backends.simulated.fields import (
    Count,
    Flag,
    Number,
    _not_bool,
    _reject_unused,
    _Strict,
)

if TYPE_CHECKING:
    from gpudaemon.backends.simulated.profile import GpuSpec
    from gpudaemon.backends.simulated.readings import SimGpu

RecoveryAction = Literal["none", "gpu_reset", "node_reboot", "drain_p2p", "drain_and_reset"]
ClockEvent = Literal["hw_slowdown", "hw_thermal", "sw_thermal", "hw_power_brake"]

# The fields each fault kind reads; set on another kind they would be ignored.
_KIND_FIELDS: dict[str, set[str]] = {
    "xid": {"xid", "count"},
    "ecc": {"corrected", "uncorrected"},
    "lost": set(),
    "row_remap": {"pending", "failure", "correctable", "uncorrectable"},
    "recovery_action": {"action"},
    "nvlink_errors": {"link", "crc_flit", "crc_data", "replay", "recovery"},
    "clock_event": {"reasons"},
}


class FaultSpec(_Strict):
    kind: Literal[
        "xid", "lost", "ecc", "row_remap", "recovery_action", "nvlink_errors", "clock_event"
    ]
    gpu: int | None = None  # node-level faults name the GPU index
    xid: Annotated[int, Field(ge=1, le=1_000_000)] = 79
    count: Annotated[Count, Field(ge=1)] = 1
    corrected: Annotated[Count, Field(ge=0)] = 0
    uncorrected: Annotated[Count, Field(ge=0)] = 0
    # row_remap: the remapper's state from now on; rows are added to its counts.
    pending: Flag = False
    failure: Flag = False
    correctable: Annotated[Count, Field(ge=0)] = 0
    uncorrectable: Annotated[Count, Field(ge=0)] = 0
    # recovery_action: the driver's recovery action from now on.
    action: RecoveryAction = "none"
    # nvlink_errors: counts added to one link's counters on every poll from now on.
    link: Annotated[int, Field(ge=0, le=35), BeforeValidator(_not_bool)] = 0
    crc_flit: Annotated[Count, Field(ge=0)] = 0
    crc_data: Annotated[Count, Field(ge=0)] = 0
    replay: Annotated[Count, Field(ge=0)] = 0
    recovery: Annotated[Count, Field(ge=0)] = 0
    # clock_event: the clock event reasons active from now on ([] ends them).
    reasons: tuple[ClockEvent, ...] = ()
    after_s: Annotated[Number, Field(ge=0, le=1e9)] = 0.0
    after_polls: Annotated[Count, Field(ge=0)] = 0
    # A fault a GPU reset does not fix (a part that is really broken): it fires again
    # right after every reset, so the remediation loop must escalate.
    persistent: Flag = False

    @model_validator(mode="after")
    def _fields_of_its_kind(self) -> FaultSpec:
        """A field of another kind would be ignored, so it is an error; a fault that
        would change nothing is one too."""
        others = set().union(*_KIND_FIELDS.values()) - _KIND_FIELDS[self.kind]
        _reject_unused(self.model_fields_set & others, f"kind {self.kind}")
        if self.kind == "ecc" and not (self.corrected or self.uncorrected):
            raise ValueError("kind ecc needs corrected or uncorrected above 0")
        if self.kind == "row_remap" and not self.model_fields_set & _KIND_FIELDS["row_remap"]:
            raise ValueError(
                "kind row_remap needs one of pending, failure, correctable, uncorrectable"
            )
        if self.kind == "recovery_action" and "action" not in self.model_fields_set:
            raise ValueError(
                "kind recovery_action needs action (none, gpu_reset, node_reboot, "
                "drain_p2p, drain_and_reset)"
            )
        if self.kind == "nvlink_errors" and not (
            self.crc_flit or self.crc_data or self.replay or self.recovery
        ):
            raise ValueError(
                "kind nvlink_errors needs crc_flit, crc_data, replay or recovery above 0"
            )
        if self.kind == "clock_event" and "reasons" not in self.model_fields_set:
            raise ValueError("kind clock_event needs reasons (a list; [] ends the events)")
        return self


def _ampere(spec: GpuSpec) -> bool:
    return int(spec.compute_capability.split(".")[0]) >= 8


def _fault_misfit(f: FaultSpec, spec: GpuSpec) -> str | None:
    """Why this GPU cannot give the fault's signal (as a real one would not), or None."""
    if f.kind == "ecc" and not spec.ecc:
        return "an ecc fault needs ecc: true"
    if f.kind == "row_remap" and not (spec.ecc and _ampere(spec)):
        return "a row_remap fault needs ecc: true and compute_capability 8.0 or later"
    if f.kind == "nvlink_errors" and not (spec.nvlink_links and f.link < spec.nvlink_links):
        return f"an nvlink_errors fault on link {f.link} needs nvlink_links above {f.link}"
    return None


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
