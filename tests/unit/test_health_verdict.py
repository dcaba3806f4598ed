"""The verdict table (health/verdict.py, health/xid.py), row by row: each signal gives
the state and action its row says, the worst finding wins, and the rows that need
history (growth, rate, the clock-event hold) work on the agent's HealthJudge."""

from __future__ import annotations

import dataclasses

import pytest

from gpudaemon.backends.base import APPLICATION_XIDS, is_critical_xid
from gpudaemon.health import verdict
from gpudaemon.health.verdict import HealthJudge, Verdict, judge
from gpudaemon.health.xid import XIDS, xid_rule
from gpudaemon.model import GpuSample

S = GpuSample(index=0, uuid="GPU-0")


@pytest.mark.parametrize(
    ("change", "state", "action", "reason"),
    [
        ({}, "healthy", "none", ""),
        ({"lost": True}, "unhealthy", "reboot_node", "gpu lost"),
        ({"row_remap_pending": True}, "unhealthy", "reset_gpu", "row remap pending"),
        ({"row_remap_failed": True}, "unhealthy", "replace", "row remap failure"),
        ({"row_remap_pending": False, "row_remap_failed": False}, "healthy", "none", ""),
        ({"recovery_action": "none"}, "healthy", "none", ""),
        ({"recovery_action": "gpu_reset"}, "unhealthy", "reset_gpu", "recovery gpu_reset"),
        ({"recovery_action": "node_reboot"}, "unhealthy", "reboot_node", "recovery node_reboot"),
        ({"recovery_action": "drain_p2p"}, "unhealthy", "drain", "recovery drain_p2p"),
        (
            {"recovery_action": "drain_and_reset"},
            "unhealthy",
            "reset_gpu",
            "recovery drain_and_reset",
        ),
        ({"recovery_action": "action_7"}, "unhealthy", "reset_gpu", "recovery action_7"),
        ({"ecc_uncorrected_errors_total": 2}, "unhealthy", "reset_gpu", "ecc uncorrected errors"),
        ({"ecc_uncorrected_errors_total": 0}, "healthy", "none", ""),
        ({"retired_pages_pending": True}, "unhealthy", "reset_gpu", "page retirement pending"),
        ({"clock_events_active": frozenset()}, "healthy", "none", ""),
        (
            {"clock_events_active": frozenset({"hw_slowdown"})},
            "degraded",
            "watch",
            "clock event hw_slowdown",
        ),
        (
            {"clock_events_active": frozenset({"hw_thermal"})},
            "degraded",
            "watch",
            "clock event hw_thermal",
        ),
        (
            {"clock_events_active": frozenset({"sw_thermal"})},
            "degraded",
            "watch",
            "clock event sw_thermal",
        ),
        (
            {"clock_events_active": frozenset({"hw_power_brake"})},
            "degraded",
            "watch",
            "clock event hw_power_brake",
        ),
        ({"xid_errors_total": {13: 5}}, "healthy", "none", ""),
        ({"xid_errors_total": {48: 1}}, "unhealthy", "reset_gpu", "xid 48"),
        ({"xid_errors_total": {63: 1}}, "unhealthy", "reset_gpu", "xid 63"),
        ({"xid_errors_total": {64: 1}}, "unhealthy", "replace", "xid 64"),
        ({"xid_errors_total": {74: 1}}, "unhealthy", "reset_gpu", "xid 74"),
        ({"xid_errors_total": {79: 1}}, "unhealthy", "reboot_node", "xid 79"),
        ({"xid_errors_total": {92: 1}}, "degraded", "watch", "xid 92"),
        ({"xid_errors_total": {94: 1}}, "unhealthy", "reset_gpu", "xid 94"),
        ({"xid_errors_total": {95: 1}}, "unhealthy", "reboot_node", "xid 95"),
        ({"xid_errors_total": {119: 1}}, "unhealthy", "reset_gpu", "xid 119"),
        ({"xid_errors_total": {120: 1}}, "unhealthy", "reset_gpu", "xid 120"),
        ({"xid_errors_total": {154: 1}}, "healthy", "none", ""),
        ({"xid_errors_total": {999: 1}}, "unhealthy", "reset_gpu", "xid 999"),
    ],
)
def test_each_row_gives_its_state_and_action(
    change: dict[str, object], state: str, action: str, reason: str
) -> None:
    s = judge(dataclasses.replace(S, **change))  # type: ignore[arg-type]
    assert (s.health_state, s.health_action, s.health_reason) == (state, action, reason)
    assert s.healthy == (state != "unhealthy")  # degraded is schedulable


def test_the_worst_finding_wins_state_first_then_action() -> None:
    s = judge(
        dataclasses.replace(
            S,
            clock_events_active=frozenset({"hw_slowdown"}),
            row_remap_pending=True,
            row_remap_failed=True,
            xid_errors_total={79: 1},
        )
    )
    assert (s.health_state, s.health_action) == ("unhealthy", "replace")
    assert judge(dataclasses.replace(S, lost=True, row_remap_pending=True)).health_action == (
        "reboot_node"
    )


def test_every_rule_and_xid_row_names_a_known_state_action_and_source() -> None:
    for key, r in verdict.RULES.items():
        assert r.state in verdict.STATES and r.action in verdict.ACTIONS and r.source, key
    for xid, x in XIDS.items():
        assert x.state in verdict.STATES and x.action in verdict.ACTIONS and x.source, xid
        assert (x.state == "unhealthy") == is_critical_xid(xid), xid
    for xid in APPLICATION_XIDS:
        assert xid_rule(xid, APPLICATION_XIDS).state == "healthy"


def test_a_remembered_fault_keeps_its_action_after_a_restart() -> None:
    assert verdict.remembered("xid 79") == Verdict("unhealthy", "reboot_node", "xid 79")
    assert verdict.remembered("xid 48").action == "reset_gpu"
    assert verdict.remembered("ecc uncorrected errors").action == "reset_gpu"


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_correctable_remaps_growing_degrade_for_an_hour() -> None:
    clock = Clock()
    j = HealthJudge(clock=clock)
    one = judge(dataclasses.replace(S, remapped_rows_correctable=1))
    assert j.apply([one])[0].health_state == "healthy"  # the first reading: no growth yet
    clock.t += 30
    two = judge(dataclasses.replace(S, remapped_rows_correctable=2))
    s = j.apply([two])[0]
    assert (s.health_state, s.health_action, s.health_reason) == (
        "degraded",
        "watch",
        "correctable row remaps growing",
    )
    assert s.healthy
    clock.t += verdict.REMAP_HOLD_S + 1
    assert j.apply([two])[0].health_state == "healthy"


def _links(n: int) -> GpuSample:
    return judge(dataclasses.replace(S, nvlink_errors_total={0: {"crc_flit": n, "replay": 0}}))


def test_nvlink_errors_above_the_rate_degrade_and_below_do_not() -> None:
    clock = Clock()
    j = HealthJudge(clock=clock, nvlink_window_s=60, nvlink_errors_per_s=1.0)
    assert j.apply([_links(0)])[0].health_state == "healthy"
    clock.t += 60
    assert j.apply([_links(30)])[0].health_state == "healthy"  # 0.5/s
    clock.t += 60
    s = j.apply([_links(200)])[0]  # 200 over 120 s: 1.7/s
    assert (s.health_state, s.health_action, s.health_reason) == (
        "degraded",
        "watch",
        "nvlink errors above rate",
    )


def test_a_clock_event_holds_degraded_so_the_annotation_does_not_flap() -> None:
    clock = Clock()
    j = HealthJudge(clock=clock)
    hot = judge(dataclasses.replace(S, clock_events_active=frozenset({"hw_thermal"})))
    cool = judge(dataclasses.replace(S, clock_events_active=frozenset()))
    assert j.apply([hot])[0].health_state == "degraded"
    clock.t += 5
    assert j.apply([cool])[0].health_reason == "clock event hw_thermal"
    clock.t += verdict.CLOCK_EVENT_HOLD_S
    assert j.apply([cool])[0].health_state == "healthy"


def test_an_unhealthy_verdict_is_not_softened_by_the_judge() -> None:
    clock = Clock()
    j = HealthJudge(clock=clock)
    bad = judge(dataclasses.replace(S, row_remap_pending=True, remapped_rows_correctable=1))
    j.apply([bad])
    clock.t += 1
    bad2 = dataclasses.replace(bad, remapped_rows_correctable=2)
    assert j.apply([bad2])[0].health_action == "reset_gpu"
