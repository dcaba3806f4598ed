"""The simulated fault kinds and their fields. What each needs of the GPU is checked
with the profile (`profile.py`), what each does to the GPU's state when it fires is in
`effects.py`: this module imports neither."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, model_validator

from gpudaemon.backends.simulated.fields import (
    Count,
    Flag,
    Number,
    _not_bool,
    _reject_unused,
    _Strict,
)

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
