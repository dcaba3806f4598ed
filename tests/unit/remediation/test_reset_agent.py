"""The agent's half of a GPU reset (agent/reset.py) on simulated GPUs: a grant resets a
GPU that nobody uses and returns it; a GPU a pod holds, or with a process on it, is
never reset; a fault that a reset does not fix escalates to reboot_node after
max_attempts, with its Event. And what a simulated reset clears and what it keeps."""

from __future__ import annotations

import time
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from gpudaemon.agent.cache import Cache
from gpudaemon.agent.healthmemory import AnnotationStore, HealthMemory
from gpudaemon.agent.metrics.selfmetrics import AgentMetrics
from gpudaemon.agent.poller import Poller
from gpudaemon.agent.reset import GpuResetter
from gpudaemon.backends.simulated import FaultSpec, SimulatedBackend
from gpudaemon.backends.simulated.profile import parse_profile
from gpudaemon.config.remediation import RemediationConfig
from gpudaemon.model import PodRef
from gpudaemon.remediation.grant import Grant
from tests.support import wait_for

KEY = "gpudaemon.io/gpu-reset"


def backend(pattern: str = "idle") -> SimulatedBackend:
    return SimulatedBackend(parse_profile(
        "gpus: [{name: NVIDIA H100 80GB HBM3, memory_total_mib: 81559, compute_capability: '9.0',"
        f" count: 4, nvlink_links: 18, utilization: {{pattern: {pattern}}}}}]"
    ))  # fmt: skip


class Rig:
    def __init__(self, pattern: str = "idle", **cfg: Any) -> None:
        self.backend = backend(pattern)
        self.cache = Cache()
        self.memory = HealthMemory(AnnotationStore("gpudaemon.io/gpu-faults"), "boot-1")
        self.poller = Poller(self.backend, self.cache, self.memory)
        self.registry = CollectorRegistry()
        self.metrics = AgentMetrics(self.registry)
        self.pods: dict[str, PodRef] = {}
        self.events: list[tuple[str, str, bool]] = []
        self.cleared: list[str] = []
        self.reconciles = 0
        self.cfg = RemediationConfig.model_validate({"reset_gpu": True, "settle_s": 0.5, **cfg})
        self.r = GpuResetter(
            self.cfg, self.backend, self.memory, self.metrics, grant_key=KEY,
            snapshot=self.cache.get, pods=lambda: self.pods, poll=self.poller.telemetry,
            reconcile=self._reconcile, clear_grant=self.cleared.append,
            event=lambda *e: self.events.append(e),
        )  # fmt: skip
        self.poller.remediation = self.r.apply
        self.poller.inventory()
        self.poller.telemetry()

    def _reconcile(self) -> None:
        self.reconciles += 1

    def uuid(self, i: int) -> str:
        inv = self.cache.get().inventory
        assert inv is not None
        return inv.gpus[i].uuid

    def sample(self, i: int) -> Any:
        return self.cache.get().samples[i]

    def fault(self, i: int, **f: Any) -> None:
        self.backend.inject(i, FaultSpec.model_validate(f))
        self.poller.telemetry()

    def grant(self, i: int, at: float | None = None) -> str:
        at = time.time() if at is None else at
        g = Grant(self.uuid(i), i, at, at + 300)
        self.r.on_node({"metadata": {"annotations": {KEY: g.encode()}}})
        return self.r.step()

    def resets(self, result: str, gpu: int) -> float:
        labels = {"gpu": str(gpu), "uuid": self.uuid(gpu), "result": result}
        return self.registry.get_sample_value("gpudaemon_gpu_resets_total", labels) or 0.0


def test_a_granted_reset_returns_the_gpu_and_clears_its_record() -> None:
    rig = Rig()
    rig.fault(2, kind="xid", xid=48)
    assert rig.sample(2).health_action == "reset_gpu"
    assert rig.uuid(2) in rig.memory.faults  # sticky: only a reset clears it
    assert rig.grant(2) == "success"
    s = rig.sample(2)
    assert s.healthy and s.health_state == "healthy" and s.xid_errors_total == {}
    assert rig.uuid(2) not in rig.memory.faults
    [(reason, msg, warning)] = rig.events
    assert reason == "GPUReset" and not warning
    assert f"GPU 2 ({rig.uuid(2)}) reset and back in service: xid 48 cleared" in msg
    assert rig.cleared and rig.resets("success", 2) == 1
    assert rig.memory.resets_within(rig.uuid(2), 86400) == 1
    assert rig.grant(2, at=time.time() + 1) == "blocked"  # healthy now: nothing to reset


def test_a_gpu_in_reset_stays_quarantined_until_it_has_settled() -> None:
    rig = Rig(settle_s=1.0)
    rig.fault(1, kind="row_remap", pending=True)
    seen: list[str] = []
    real = rig.poller.telemetry

    def poll() -> None:
        real()
        seen.append(rig.sample(1).health_reason)

    rig.r.poll = poll
    assert rig.grant(1) == "success"
    assert seen[0] == "reset in progress (row remap pending)"  # healthy reads, still held
    assert seen[-1] == ""  # released once settled
    assert rig.backend._gpus[1].remapped_uncorrectable == 1  # the pending remap took effect


@pytest.mark.parametrize("how", ["pod", "mig-free-pod-map-error", "process"])
def test_a_gpu_in_use_is_never_reset(how: str) -> None:
    rig = Rig(pattern="busy" if how == "process" else "idle")
    rig.fault(3, kind="xid", xid=48)
    if how == "pod":
        rig.pods = {rig.uuid(3): PodRef("train-0", "ml", "main")}
    elif how == "mig-free-pod-map-error":

        def broken() -> dict[str, PodRef]:
            raise OSError("kubelet socket gone")

        rig.r.pods = broken
    assert rig.grant(3) == "skipped_busy"
    assert rig.backend._gpus[3].xids == {48: 1}  # not reset
    assert rig.sample(3).health_action == "reset_gpu" and rig.events == []
    assert rig.resets("skipped_busy", 3) == 1 and rig.cleared


def test_a_persistent_fault_escalates_after_max_attempts() -> None:
    rig = Rig()
    rig.fault(0, kind="xid", xid=48, persistent=True)
    assert rig.grant(0) == "failed"
    assert rig.sample(0).health_action == "reset_gpu"  # one attempt left
    assert [e[0] for e in rig.events] == ["GPUReset"] and rig.events[0][2]
    assert "still unhealthy after the reset: xid 48" in rig.events[0][1]
    assert rig.grant(0, at=time.time() + 1) == "failed"
    s = rig.sample(0)
    assert (s.health_state, s.health_action) == ("unhealthy", "reboot_node")
    assert s.health_reason == "xid 48; 2 reset(s) in 24 h did not fix it"
    assert [e[0] for e in rig.events] == ["GPUReset", "GPUReset", "GPUResetFailed"]
    labels = {"gpu": "0", "uuid": rig.uuid(0)}
    assert rig.registry.get_sample_value("gpudaemon_gpu_reset_escalated", labels) == 1
    assert rig.grant(0, at=time.time() + 2) == "blocked"  # no third attempt
    assert rig.resets("failed", 0) == 2


def test_the_attempts_survive_a_restart_through_the_record() -> None:
    rig = Rig()
    rig.fault(0, kind="xid", xid=48, persistent=True)
    rig.grant(0)
    rig.grant(0, at=time.time() + 1)
    store = rig.memory.store
    assert isinstance(store, AnnotationStore) and '"resets"' in store.value
    again = AnnotationStore("gpudaemon.io/gpu-faults")
    again.seed({"metadata": {"annotations": {again.key: store.value}}})
    memory = HealthMemory(again, "boot-2")  # even a reboot: the GPU is still the GPU
    assert memory.resets_within(rig.uuid(0), 86400) == 2


def test_lost_gpus_and_stale_or_foreign_grants_are_not_acted_on() -> None:
    rig = Rig()
    rig.fault(1, kind="lost")
    assert rig.grant(1) == "blocked" and rig.events == []
    rig.fault(2, kind="xid", xid=48)
    assert rig.grant(2, at=time.time() - 1000) == ""  # ran out: ignored, not removed
    g = Grant("GPU-not-here", 2, time.time(), time.time() + 300)
    rig.r.on_node({"metadata": {"annotations": {KEY: g.encode()}}})
    assert rig.r.step() == "blocked"
    rig.r.on_node({"metadata": {"annotations": {KEY: '{"uuid": ['}}})  # unreadable: ignored
    assert rig.r.step() == ""
    assert rig.backend._gpus[2].xids == {48: 1}


def test_the_simulator_reset_clears_what_a_reset_clears_and_keeps_the_rest() -> None:
    b = backend()
    b.inventory()
    for f in (
        {"kind": "xid", "xid": 94, "gpu": 0},
        {"kind": "ecc", "uncorrected": 3, "corrected": 5},
        {"kind": "recovery_action", "action": "drain_and_reset"},
        {"kind": "row_remap", "failure": True},
    ):
        b.inject(0, FaultSpec.model_validate({k: v for k, v in f.items() if k != "gpu"}))
    b.sample()
    assert b.reset_gpu(0, "/unused", 5).ok
    g = b._gpus[0]
    assert (g.xids, g.ecc_uncorrected, g.ecc_corrected, g.recovery_action) == ({}, 0, 0, "none")
    assert g.remap_failed  # a remap failure needs the GPU replaced
    s = b.sample()[0]
    assert (s.health_state, s.health_action) == ("unhealthy", "replace")


def test_a_persistent_xid_comes_back_through_the_event_path_too() -> None:
    """With a listener, XID faults are driver events (as on a GPU node): the persistent
    one must fire again after a reset there as well."""
    b = backend()
    b.inventory()
    seen: list[tuple[int, int]] = []
    b.subscribe(lambda i, x: seen.append((i, x)))
    try:
        b.inject(1, FaultSpec(kind="xid", xid=48, persistent=True))
        wait_for(lambda: seen, 10, interval=0.01, what="the XID event")
        assert seen == [(1, 48)]
        assert b.reset_gpu(1, "/unused", 5).ok
        wait_for(lambda: len(seen) >= 2, 10, interval=0.01, what="the XID again after the reset")
        assert seen == [(1, 48), (1, 48)]
        assert b.sample()[1].health_action == "reset_gpu"
    finally:
        b.close()
