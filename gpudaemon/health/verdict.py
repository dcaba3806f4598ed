"""The verdict per GPU: a state and the action it needs, from one table.

Each signal a GPU gives maps, by a row of `RULES` (or, for XIDs, of health/xid.py), to
a state (healthy, degraded, unhealthy) and an action (none, watch, drain, reset_gpu,
reboot_node, replace), with the row's source. A GPU's verdict is the worst row that
applies: the state first, then the action (a GPU that needs replacing also needs a
reset, so `replace` wins). `unhealthy` GPUs are not schedulable (`healthy=False`, as
before); `degraded` ones are, but are watched. docs/operations.md ("GPU health")
explains every row to an operator.

`judge` is a pure function of one sample (every backend calls it, so `probe` shows it);
`HealthJudge` adds the rows that need history, a counter's growth or rate, on the agent.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from gpudaemon.health.xid import APPLICATION_XIDS, xid_rule
from gpudaemon.model import GpuSample

STATES = ("healthy", "degraded", "unhealthy")
ACTIONS = ("none", "watch", "drain", "reset_gpu", "reboot_node", "replace")

# The reasons kept from before (healthmemory records and old readers match them).
LOST_REASON = "gpu lost"
ECC_REASON = "ecc uncorrected errors"

NVML_DOC = "NVML API reference"
REMAP_DOC = "NVIDIA A100/H100 row remapping guide (docs.nvidia.com/deploy/a100-gpu-mem-error-mgmt)"
RETIRE_DOC = "NVIDIA dynamic page retirement guide (docs.nvidia.com/deploy/dynamic-page-retirement)"


@dataclass(frozen=True)
class Rule:
    state: str
    action: str
    source: str


# signal -> (state, action, source). Keys with a ':' take a value (the recovery action's
# name, the clock event's reason). XIDs: health/xid.py.
RULES: dict[str, Rule] = {
    "lost": Rule("unhealthy", "reboot_node", f"{NVML_DOC}: NVML_ERROR_GPU_IS_LOST; XID 79"),
    "row_remap_failure": Rule(
        "unhealthy", "replace", f"{REMAP_DOC}: remapping failure, the GPU is out of spare rows"
    ),
    "row_remap_pending": Rule(
        "unhealthy", "reset_gpu", f"{REMAP_DOC}: a pending remap takes effect on GPU reset"
    ),
    "recovery_action:gpu_reset": Rule("unhealthy", "reset_gpu", f"{NVML_DOC}: GPU_RESET"),
    "recovery_action:node_reboot": Rule("unhealthy", "reboot_node", f"{NVML_DOC}: NODE_REBOOT"),
    "recovery_action:drain_p2p": Rule("unhealthy", "drain", f"{NVML_DOC}: DRAIN_P2P"),
    "recovery_action:drain_and_reset": Rule(
        "unhealthy", "reset_gpu", f"{NVML_DOC}: DRAIN_AND_RESET"
    ),
    # A value newer than this table (IMEX domain, bus reset, system reboot): the driver
    # wants something done; a reset is the least that any of them includes.
    "recovery_action:other": Rule("unhealthy", "reset_gpu", f"{NVML_DOC}: newer recovery action"),
    "ecc_uncorrected": Rule(
        "unhealthy", "reset_gpu", "NVIDIA XID catalog: WORKFLOW_XID_48 (uncorrected ECC)"
    ),
    "retired_pages_pending": Rule(
        "unhealthy", "reset_gpu", f"{RETIRE_DOC}: a pending retirement needs a driver reload"
    ),
    "clock_event:hw_slowdown": Rule("degraded", "watch", f"{NVML_DOC}: HwSlowdown"),
    "clock_event:hw_thermal": Rule("degraded", "watch", f"{NVML_DOC}: HwThermalSlowdown"),
    "clock_event:sw_thermal": Rule("degraded", "watch", f"{NVML_DOC}: SwThermalSlowdown"),
    "clock_event:hw_power_brake": Rule("degraded", "watch", f"{NVML_DOC}: HwPowerBrakeSlowdown"),
    "correctable_remaps_growing": Rule(
        "degraded", "watch", f"{REMAP_DOC}: correctable remaps are spare rows being used up"
    ),
    "nvlink_errors_rate": Rule(
        "degraded", "watch", "DCGM NVLink health watch: error counters rising predict failure"
    ),
}


@dataclass(frozen=True)
class Verdict:
    state: str = "healthy"
    action: str = "none"
    reason: str = ""

    @property
    def rank(self) -> tuple[int, int]:
        return STATES.index(self.state), ACTIONS.index(self.action)


HEALTHY = Verdict()


def _rule(key: str, reason: str) -> Verdict:
    r = RULES[key]
    return Verdict(r.state, r.action, reason)


def findings(s: GpuSample, application_xids: frozenset[int]) -> list[Verdict]:
    """Every row that applies to one sample (unordered)."""
    out: list[Verdict] = []
    if s.lost:
        out.append(_rule("lost", LOST_REASON))
    if s.row_remap_failed:
        out.append(_rule("row_remap_failure", "row remap failure"))
    if s.row_remap_pending:
        out.append(_rule("row_remap_pending", "row remap pending"))
    action = s.recovery_action
    if action is not None and action != "none":
        key = f"recovery_action:{action}"
        out.append(_rule(key if key in RULES else "recovery_action:other", f"recovery {action}"))
    for xid in sorted(s.xid_errors_total):
        x = xid_rule(xid, application_xids)
        if x.state != "healthy":
            out.append(Verdict(x.state, x.action, f"xid {xid}"))
    if s.ecc_uncorrected_errors_total:
        out.append(_rule("ecc_uncorrected", ECC_REASON))
    if s.retired_pages_pending:
        out.append(_rule("retired_pages_pending", "page retirement pending"))
    for reason in sorted(s.clock_events_active or ()):
        out.append(_rule(f"clock_event:{reason}", f"clock event {reason}"))
    return out


def worst(found: Sequence[Verdict]) -> Verdict:
    """The verdict: the worst finding (state, then action); the first of equals."""
    best = HEALTHY
    for v in found:
        if v.rank > best.rank:
            best = v
    return best


def apply(s: GpuSample, v: Verdict) -> GpuSample:
    healthy = v.state != "unhealthy"
    if (s.healthy, s.health_reason, s.health_state, s.health_action) == (
        healthy,
        v.reason,
        v.state,
        v.action,
    ):
        return s  # already so (a healthy GPU, every poll): no copy of ~50 fields
    return replace(
        s,
        healthy=v.state != "unhealthy",
        health_reason=v.reason,
        health_state=v.state,
        health_action=v.action,
    )


def judge(s: GpuSample, application_xids: frozenset[int] | None = None) -> GpuSample:
    """The sample with its verdict set, from its own readings alone."""

    apps = APPLICATION_XIDS if application_xids is None else application_xids
    return apply(s, worst(findings(s, apps)))


def remembered(reason: str) -> Verdict:
    """The verdict of a fault recorded across a restart (healthmemory), by its reason."""

    if reason.startswith("xid ") and reason[4:].isdigit():
        x = xid_rule(int(reason[4:]), APPLICATION_XIDS)
        if x.state == "unhealthy":
            return Verdict(x.state, x.action, reason)
    if reason == ECC_REASON:
        return _rule("ecc_uncorrected", reason)
    return Verdict("unhealthy", "reset_gpu", reason)


# Growth and rate rows (HealthJudge): degraded while it lasts, and `hold_s` after.
REMAP_HOLD_S = 3600.0  # correctable remaps rose within the last hour
NVLINK_WINDOW_S = 60.0  # the NVLink rate is taken over at least this long
NVLINK_ERRORS_PER_S = 1.0  # above it (60 a minute, all links and types), degraded
NVLINK_HOLD_S = 600.0
# A clock event comes and goes with load and temperature: the GPU stays degraded this
# long after the last poll that saw it, so the annotation and label do not flap.
CLOCK_EVENT_HOLD_S = 300.0


@dataclass
class _History:
    remaps: int | None = None
    remaps_rose_at: float | None = None
    nvlink: list[tuple[float, int]] = field(default_factory=list)
    nvlink_high_at: float | None = None
    clock_seen: dict[str, float] = field(default_factory=dict)


class HealthJudge:
    """The rows that need more than one sample: correctable remaps growing, NVLink
    errors above a rate. Applied to every telemetry poll on the agent (poller.py)."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        nvlink_window_s: float = NVLINK_WINDOW_S,
        nvlink_errors_per_s: float = NVLINK_ERRORS_PER_S,
    ) -> None:
        self.clock = clock
        self.nvlink_window_s = nvlink_window_s
        self.nvlink_errors_per_s = nvlink_errors_per_s
        self._gpus: dict[str, _History] = {}

    def apply(self, samples: Sequence[GpuSample]) -> tuple[GpuSample, ...]:

        now = self.clock()
        out = []
        for s in samples:
            extra = self._growth(s, now) if s.uuid and not s.lost else []
            if extra:
                s = apply(s, worst([*findings(s, APPLICATION_XIDS), *extra]))
            out.append(s)
        return tuple(out)

    def _growth(self, s: GpuSample, now: float) -> list[Verdict]:
        h = self._gpus.setdefault(s.uuid, _History())
        out = []
        c = s.remapped_rows_correctable
        if c is not None:
            if h.remaps is not None and c > h.remaps:
                h.remaps_rose_at = now
            h.remaps = c
        if h.remaps_rose_at is not None and now - h.remaps_rose_at <= REMAP_HOLD_S:
            out.append(_rule("correctable_remaps_growing", "correctable row remaps growing"))
        if s.nvlink_errors_total:
            total = sum(n for counts in s.nvlink_errors_total.values() for n in counts.values())
            h.nvlink.append((now, total))
            # Keep the newest reading at least a window old, and every one after it.
            while len(h.nvlink) > 2 and now - h.nvlink[1][0] >= self.nvlink_window_s:
                h.nvlink.pop(0)
            t0, n0 = h.nvlink[0]
            span = now - t0
            fast = span > 0 and (total - n0) / span > self.nvlink_errors_per_s
            if span >= self.nvlink_window_s and fast:
                h.nvlink_high_at = now
        if h.nvlink_high_at is not None and now - h.nvlink_high_at <= NVLINK_HOLD_S:
            out.append(_rule("nvlink_errors_rate", "nvlink errors above rate"))
        for reason in s.clock_events_active or ():
            h.clock_seen[reason] = now
        for reason, seen in sorted(h.clock_seen.items()):
            if now - seen <= CLOCK_EVENT_HOLD_S and reason not in (s.clock_events_active or ()):
                out.append(_rule(f"clock_event:{reason}", f"clock event {reason}"))
        return out
