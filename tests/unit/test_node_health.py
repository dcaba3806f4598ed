"""The GPUHealthy Node condition and the opt-in taint (issue 17), on the sink's fake API
server: written only on change, never touching another writer's taints; its message
names each unhealthy or degraded GPU's state, reason and action (issue 30). The real API
server and admission policy side is tests/integration/kube/test_node_health.py."""

from __future__ import annotations

from dataclasses import replace

from gpudaemon.agent.nodehealth import Condition, condition_for
from gpudaemon.health.verdict import judge
from gpudaemon.labels import GpuHealth, Labels, LabelSet, NodeLabeler
from gpudaemon.model import GpuSample, Snapshot
from tests.unit.test_kube import P, make

LOST = GpuHealth(5, "gpu lost", "unhealthy", "reboot_node")
PENDING = GpuHealth(1, "row remap pending", "unhealthy", "reset_gpu")
SLOW = GpuHealth(2, "clock event hw_slowdown", "degraded", "watch")


def health_ls(unhealthy: tuple[GpuHealth | tuple[int, str], ...] = ()) -> LabelSet:
    entries = tuple(u if isinstance(u, GpuHealth) else GpuHealth(*u) for u in unhealthy)
    sick = sum(g.state == "unhealthy" for g in entries)
    labels = Labels(P, {"gpu.count": 8, "gpu.unhealthy": sick})
    return LabelSet(labels, {P + "gpus": "[]"}, verdicts=entries, gpus=8)


def test_condition_names_each_gpu_state_reason_and_action() -> None:
    c = condition_for([LOST, PENDING], 8)
    assert (c.status, c.reason) == ("False", "GPUUnhealthy")
    assert c.message == (
        "2 of 8 GPU(s) unhealthy: GPU 1: row remap pending (unhealthy, action reset_gpu); "
        "GPU 5: gpu lost (unhealthy, action reboot_node)"
    )
    assert condition_for([], 8) == Condition("True", "AllGPUsHealthy", "all 8 GPU(s) healthy")


def test_a_bare_index_and_reason_is_an_unhealthy_gpu_whose_action_is_not_known() -> None:
    c = condition_for([(3, "xid 79")], 8)
    assert (c.status, c.message) == ("False", "1 of 8 GPU(s) unhealthy: GPU 3: xid 79 (unhealthy)")


def test_degraded_gpus_keep_the_condition_true_and_are_named() -> None:
    """Degraded GPUs are schedulable: the node is not marked unhealthy for them, but
    `kubectl describe node` says which are watched and why."""
    c = condition_for([SLOW], 8)
    assert (c.status, c.reason) == ("True", "GPUDegraded")
    assert c.message == (
        "1 of 8 GPU(s) degraded (schedulable, watched): "
        "GPU 2: clock event hw_slowdown (degraded, action watch)"
    )
    both = condition_for([SLOW, LOST], 8)
    assert (both.status, both.reason) == ("False", "GPUUnhealthy")
    assert both.message == (
        "1 of 8 GPU(s) unhealthy: GPU 5: gpu lost (unhealthy, action reboot_node). "
        "1 of 8 GPU(s) degraded (schedulable, watched): "
        "GPU 2: clock event hw_slowdown (degraded, action watch)"
    )


def test_a_long_message_is_cut_to_one_short_line() -> None:
    many = [GpuHealth(i, "x" * 200, "unhealthy", "replace") for i in range(8)]
    c = condition_for(many, 8)
    assert len(c.message) == 1024 and c.message.endswith("...")


def test_the_labeler_hands_the_sink_each_gpus_verdict() -> None:
    """From the samples' verdicts (health/verdict.py) to the condition's entries: the
    healthy GPU is left out, the degraded one is in with its action."""
    base = GpuSample(index=0, uuid="GPU-0")
    samples = (
        judge(base),
        judge(replace(base, index=1, uuid="GPU-1", row_remap_pending=True)),
        judge(replace(base, index=2, uuid="GPU-2", clock_events_active=frozenset({"hw_slowdown"}))),
    )
    ls = NodeLabeler(P).build(Snapshot(samples=samples))
    assert ls.verdicts == (PENDING, SLOW)
    assert ls.gpus == 3


def test_condition_is_written_once_per_change() -> None:
    sink, fake, clock, _ = make()
    sink.apply(health_ls())
    assert fake.conditions["GPUHealthy"]["status"] == "True"
    n = fake.calls.count("condition")
    for _ in range(5):
        clock.t += 30
        sink.apply(health_ls())
    assert fake.calls.count("condition") == n
    sink.apply(health_ls(((3, "xid 79"),)))
    c = fake.conditions["GPUHealthy"]
    assert (c["status"], c["reason"]) == ("False", "GPUUnhealthy")
    assert "GPU 3: xid 79 (unhealthy)" in c["message"]
    assert fake.calls.count("condition") == n + 1
    assert fake.taints == []  # the taint is opt-in


def test_a_degraded_gpu_is_written_once_and_never_taints() -> None:
    sink, fake, clock, _ = make()
    sink.health.taint = True
    sink.apply(health_ls())
    n = fake.calls.count("condition")
    for _ in range(3):  # the verdict holds degraded: the same entries every poll
        clock.t += 30
        sink.apply(health_ls((SLOW,)))
    c = fake.conditions["GPUHealthy"]
    assert (c["status"], c["reason"]) == ("True", "GPUDegraded")
    assert "GPU 2: clock event hw_slowdown (degraded, action watch)" in c["message"]
    assert fake.calls.count("condition") == n + 1
    assert fake.taints == []  # schedulable: no taint
    sink.apply(health_ls((SLOW, PENDING)))
    c = fake.conditions["GPUHealthy"]
    assert (c["status"], c["reason"]) == ("False", "GPUUnhealthy")
    assert "GPU 1: row remap pending (unhealthy, action reset_gpu)" in c["message"]
    assert fake.taints == [{"key": P + "gpu-unhealthy", "effect": "NoSchedule"}]
    assert fake.calls.count("condition") == n + 2


def test_a_restarted_agent_does_not_rewrite_a_condition_that_is_right() -> None:
    sink, fake, _, _ = make()
    sink.apply(health_ls(((3, "xid 79"),)))
    again, _, _, _ = make()
    again.client = fake
    again.lease.client = fake  # type: ignore[assignment]
    n = fake.calls.count("condition")
    again.apply(health_ls(((3, "xid 79"),)))
    assert fake.calls.count("condition") == n


def test_the_opt_in_taint_comes_and_goes_and_keeps_other_taints() -> None:
    sink, fake, _, _ = make()
    sink.health.taint = True
    other = {"key": "dedicated", "value": "ml", "effect": "NoSchedule"}
    fake.taints = [other]
    sink.apply(health_ls(((3, "xid 79"),)))
    assert fake.taints == [other, {"key": P + "gpu-unhealthy", "effect": "NoSchedule"}]
    sink.apply(health_ls())
    assert fake.taints == [other]
