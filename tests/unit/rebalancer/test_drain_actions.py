"""Drain by the verdict's action (issue 30): a GPU whose action is drain, reset_gpu,
reboot_node or replace has its pods evicted after the grace period; reboot_node takes
every GPU pod of the node; watch (a degraded GPU) and none leave them alone; an older
agent's unhealthy GPU (no action) is drained as before. Events and the metric name the
action."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gpudaemon.labels.annotations import GpuState
from gpudaemon.rebalancer.planner import SickGpu, drain, drain_action
from tests.unit.rebalancer.test_planner import pod as facts
from tests.unit.rebalancer.test_rebalancer import P, load, metric, node, pod, rig

DRAINS = "gpudaemon_rebalancer_drain_evictions_total"


@pytest.mark.parametrize(
    ("healthy", "state", "action", "drained_for"),
    [
        (True, "healthy", "none", ""),
        (True, "degraded", "watch", ""),
        (False, "unhealthy", "drain", "drain"),
        (False, "unhealthy", "reset_gpu", "reset_gpu"),
        (False, "unhealthy", "reboot_node", "reboot_node"),
        (False, "unhealthy", "replace", "replace"),
        (False, "unhealthy", "", "drain"),  # an older agent: unhealthy -> drain, as before
        (True, "healthy", "", ""),
        (False, "unhealthy", "recalibrate", "drain"),  # a newer agent's action: not usable
        (False, "unhealthy", "watch", ""),  # never for watch
    ],
)
def test_which_gpus_are_drained_and_for_what(
    healthy: bool, state: str, action: str, drained_for: str
) -> None:
    g = GpuState(0, "GPU-0", 81559, healthy=healthy, state=state, action=action)
    assert drain_action(g) == drained_for


def test_reboot_node_takes_every_gpu_pod_of_the_node() -> None:
    pods = {
        "ml/a": facts("a", "n1"),  # on the GPU that needs the reboot
        "ml/b": facts("b", "n1", 2),  # on healthy GPUs of the same node: not in holders
        "ml/cpu": facts("cpu", "n1", 0),  # no GPU: the reboot is not its drain's business
        "ml/far": facts("far", "n2"),
    }
    [*out] = drain([SickGpu("n1", 3, "reboot_node", "xid 79", 99.0, ["ml/a"])], pods,
                   {"n1": True, "n2": True}, grace_s=60)  # fmt: skip
    assert [d.pod.name for d in out] == ["a", "b"]
    assert all(d.evict and d.action == "reboot_node" for d in out)
    assert "needs reboot_node (xid 79)" in out[1].message and "GPU 3 on n1" in out[1].message


def test_other_actions_take_only_the_gpus_holders() -> None:
    pods = {"ml/a": facts("a", "n1"), "ml/b": facts("b", "n1")}
    for action in ("drain", "reset_gpu", "replace"):
        [d] = drain([SickGpu("n1", 0, action, "r", 99.0, ["ml/a"])], pods, {"n1": True}, 60)
        assert d.pod.name == "a" and d.action == action and f"needs {action} (r)" in d.message


def verdict_node(name: str, gpus: list[tuple[str, str, list[str]]]) -> dict[str, Any]:
    """A node whose agent wrote a verdict per GPU: (state, action, holders)."""
    obj = node(name, gpus=len(gpus))
    entries = []
    for i, (state, action, holders) in enumerate(gpus):
        e: dict[str, Any] = {"index": i, "uuid": f"GPU-{name}-{i}", "memory_total_mib": 81559,
                             "healthy": state != "unhealthy", "state": state, "action": action}  # fmt: skip
        if state != "healthy":
            e["reason"] = {"degraded": "clock event hw_slowdown"}.get(state, "row remap pending")
        if holders:
            e["pods"] = holders
        entries.append(e)
    obj["metadata"]["annotations"][P + "gpus"] = json.dumps(entries)
    obj["metadata"]["labels"][P + "gpu.healthy"] = str(sum(s != "unhealthy" for s, _, _ in gpus))
    return obj


def test_a_pass_drains_by_action_and_leaves_degraded_gpus_alone() -> None:
    rb, kube, clock = rig(apply=True)  # grace 60 s
    gpus = [
        ("degraded", "watch", ["ml/slow"]),
        ("unhealthy", "reset_gpu", ["ml/remap"]),
        ("healthy", "none", ["ml/fine"]),
        ("healthy", "none", []),
    ]
    load(rb, clock, [verdict_node("n1", gpus), node("n2")],
         [pod("slow", "n1"), pod("remap", "n1"), pod("fine", "n1")])  # fmt: skip
    rb.run_pass()
    assert kube.evictions == []  # the grace period
    clock.advance(61)
    rb.run_pass()
    assert kube.evictions == [("ml/remap", False)]
    [ev] = [e for e in kube.events if e["reason"] == "RebalanceEvicted"]
    assert ev["involvedObject"]["name"] == "remap" and "needs reset_gpu" in ev["message"]
    assert metric(rb, DRAINS, action="reset_gpu", result="done") == 1
    assert metric(rb, "gpudaemon_rebalancer_evictions_total", kind="drain", result="done") == 1
    clock.advance(3600)
    rb.run_pass()
    assert kube.evictions == [("ml/remap", False)]  # the degraded GPU's pod, never


def test_reboot_node_drains_the_whole_nodes_gpu_pods() -> None:
    rb, kube, clock = rig(apply=True, grace_s=0)
    gpus = [("unhealthy", "reboot_node", ["ml/lost"]), ("healthy", "none", ["ml/other"])]
    load(rb, clock, [verdict_node("n1", gpus), node("n2")],
         [pod("lost", "n1"), pod("other", "n1"), pod("elsewhere", "n2")])  # fmt: skip
    rb.run_pass()
    assert sorted(kube.evictions) == [("ml/lost", False), ("ml/other", False)]
    assert metric(rb, DRAINS, action="reboot_node", result="done") == 2


def test_an_older_agents_unhealthy_gpu_is_drained_as_drain() -> None:
    rb, kube, clock = rig(apply=True, grace_s=0)
    load(rb, clock, [node("n1", sick={0: ["ml/a"]})], [pod("a", "n1")])  # no action field
    rb.run_pass()
    assert kube.evictions == [("ml/a", False)]
    assert metric(rb, DRAINS, action="drain", result="done") == 1


def test_the_grace_starts_when_the_action_needs_a_drain_not_when_it_degraded() -> None:
    rb, kube, clock = rig(apply=True)  # grace 60 s
    slow = verdict_node("n1", [("degraded", "watch", ["ml/a"])])
    load(rb, clock, [slow], [pod("a", "n1")])
    rb.run_pass()
    clock.advance(200)  # the agent's Lease (300 s) still fresh at the end
    rb.run_pass()
    rb.cluster.node_event("MODIFIED", verdict_node("n1", [("unhealthy", "replace", ["ml/a"])]))
    rb.run_pass()
    assert kube.evictions == []  # degraded for minutes does not count
    clock.advance(61)
    rb.run_pass()
    assert kube.evictions == [("ml/a", False)]
    assert metric(rb, DRAINS, action="replace", result="done") == 1
