"""The GPUHealthy Node condition and the opt-in taint (issue 17), on the sink's fake API
server: written only on change, never touching another writer's taints. The real API
server and admission policy side is tests/integration/kube/test_node_health.py."""

from __future__ import annotations

from gpudaemon.agent.nodehealth import condition_for
from gpudaemon.labels import Labels, LabelSet
from tests.unit.test_kube import P, make


def health_ls(unhealthy: tuple[tuple[int, str], ...] = ()) -> LabelSet:
    labels = Labels(P, {"gpu.count": 8, "gpu.unhealthy": len(unhealthy)})
    return LabelSet(labels, {P + "gpus": "[]"}, unhealthy=unhealthy, gpus=8)


def test_condition_names_the_gpus_and_reasons() -> None:
    c = condition_for([(5, "gpu lost"), (1, "xid 79")], 8)
    assert (c.status, c.reason) == ("False", "GPUUnhealthy")
    assert c.message == "2 of 8 GPU(s) unhealthy: GPU 1: xid 79; GPU 5: gpu lost"
    assert condition_for([], 8).status == "True"


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
    assert (c["status"], c["reason"]) == ("False", "GPUUnhealthy") and "GPU 3: xid 79" in c[
        "message"
    ]
    assert fake.calls.count("condition") == n + 1
    assert fake.taints == []  # the taint is opt-in


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
