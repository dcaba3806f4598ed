"""Reset a sick GPU in place, against real servers: etcd, kube-apiserver,
kube-controller-manager (ReplicaSets, the disruption controller), the real
gpudaemon-scheduler calling the extender, live agents on simulated H100s with
`remediation.reset_gpu` on, and a real `gpudaemon rebalance --apply` with it on.

1. A Deployment's two pods hold two GPUs of one 8-GPU node; the driver asks for a reset
   of the first GPU. Only that GPU's pod is evicted, after its PodDisruptionBudget
   allows it; the GPU is reset once and is healthy again (8 healthy, condition True);
   the other pod is never touched; the Node is never unschedulable; a `GPUReset` Event
   is on the Node.
2. A GPU whose remap failed (replace) is never reset; a persistent fault is reset
   max_attempts times and then escalates to reboot_node (GPUResetFailed); after XID 79
   the node's other GPU pods keep running until the node is cordoned, then go through
   the Eviction API.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from gpudaemon.backends.simulated import FaultSpec, SimulatedBackend
from tests.integration.kube.controlplane import AGENT_USER
from tests.integration.rebalancer.rig import P, RebalanceRig, metric
from tests.integration.rebalancer.test_health_actions import PDBS, holding, verdicts
from tests.integration.rebalancer.test_rebalancer import bound
from tests.integration.scheduler.rig import NS
from tests.support import scrape, wait_for

pytestmark = pytest.mark.integration

REMEDIATION = {"reset_gpu": True}  # every other setting at its default
RESETS = "gpudaemon_rebalancer_resets_total"
DRAINS = "gpudaemon_rebalancer_drain_evictions_total"


def idle_profile(rig: RebalanceRig) -> str:
    """8 idle H100s: no process on a GPU that no pod holds (the simulator's busy GPUs
    show processes, which no reset may touch)."""
    path = rig.dir / "idle-h100.yaml"
    path.write_text(
        "gpus: [{name: NVIDIA H100 80GB HBM3, memory_total_mib: 81559, compute_capability:"
        " '9.0', count: 8, nvlink_links: 18, utilization: {pattern: idle}}]\n"
    )
    return str(path)


def grant_agents_events(rig: RebalanceRig) -> None:
    """What the chart grants the agent with remediation.resetGpu: Events in `default`."""
    role = "/apis/rbac.authorization.k8s.io/v1/namespaces/default/roles"
    binding = "/apis/rbac.authorization.k8s.io/v1/namespaces/default/rolebindings"
    if any(r["metadata"]["name"] == "agent-events"
           for r in rig.cp.admin.request("GET", role).get("items") or []):  # fmt: skip
        return
    rig.cp.admin.request("POST", role, body={
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
        "metadata": {"name": "agent-events"},
        "rules": [{"apiGroups": [""], "resources": ["events"], "verbs": ["create"]}]})  # fmt: skip
    rig.cp.admin.request("POST", binding, body={
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
        "metadata": {"name": "agent-events"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                    "name": "agent-events"},
        "subjects": [{"kind": "User", "name": AGENT_USER}]})  # fmt: skip


def node_events(rig: RebalanceRig, node: str, reason: str) -> list[dict[str, Any]]:
    q = {"fieldSelector": f"involvedObject.kind=Node,involvedObject.name={node},reason={reason}"}
    return list(rig.cp.admin.request("GET", "/api/v1/namespaces/default/events",
                                     query=q).get("items") or [])  # fmt: skip


def condition(rig: RebalanceRig, node: str) -> dict[str, Any]:
    conds = rig.cp.node(node).get("status", {}).get("conditions") or []
    return next((c for c in conds if c["type"] == "GPUHealthy"), {})


def agent_metric(rig: RebalanceRig, node: str, name: str, **labels: str) -> float:
    return rig.agents[node].registry.get_sample_value(name, labels) or 0.0


class Watcher:
    """Records whether the Node was ever unschedulable, and which pods were ever
    terminating, polling every 0.2 s for the test's length."""

    def __init__(self, rig: RebalanceRig, node: str) -> None:
        self.rig, self.node = rig, node
        self.cordoned = False
        self.terminating: set[str] = set()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(0.2):
            try:
                if (self.rig.cp.node(self.node).get("spec") or {}).get("unschedulable"):
                    self.cordoned = True
                for p in self.rig.pods():
                    if p["metadata"].get("deletionTimestamp"):
                        self.terminating.add(p["metadata"]["name"])
            except Exception:  # a poll that fails is retried
                continue

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)


def test_one_gpu_is_reset_in_place_and_returned(rig: RebalanceRig) -> None:
    grant_agents_events(rig)
    profile = idle_profile(rig)
    node, spare = "reset-a", "reset-spare"
    # The spare (not in the Deployment's group) makes a fleet of 16 GPUs: one sick GPU is
    # 6 % of it, under the default circuit breaker (10 %).
    for n, group in ((node, "reset"), (spare, "reset-spare")):
        rig.add_node(n, group)
        rig.live_agent(n, simulate=profile, remediation=REMEDIATION,
                       health={"state_file": "auto"})  # fmt: skip
    rig.wait_extender_sees([node, spare])
    rig.deployment("pair", 2, 1, "reset")
    pods = wait_for(lambda: (b := bound(rig, "app=pair")) and len(b) == 2 and b, 60,
                    what="both pods bound")  # fmt: skip
    assert set(pods.values()) == {node}
    first, second = sorted(pods)
    [sick_gpu] = wait_for(lambda: holding(rig, node, first), 30, what=f"{first}'s GPU")
    [other_gpu] = wait_for(lambda: holding(rig, node, second), 30, what=f"{second}'s GPU")
    assert sick_gpu != other_gpu

    # A budget that allows no disruption: the first eviction is refused.
    rig.cp.admin.request("POST", PDBS, body={
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "pair"},
        "spec": {"minAvailable": 2, "selector": {"matchLabels": {"app": "pair"}}}})  # fmt: skip
    url = rig.start_rebalancer("reset", apply=True, remediation=REMEDIATION)
    watch = Watcher(rig, node)
    backend = rig.agents[node].backend
    assert isinstance(backend, SimulatedBackend)
    try:
        t0 = time.monotonic()
        backend.inject(sick_gpu, FaultSpec(kind="recovery_action", action="gpu_reset"))
        wait_for(lambda: verdicts(rig, node)[sick_gpu].get("action") == "reset_gpu", 30,
                 what="the verdict: reset_gpu")  # fmt: skip
        wait_for(lambda: metric(url, DRAINS, action="reset_gpu", result="refused_pdb") >= 1, 60,
                 what="the PDB's refusal")  # fmt: skip
        assert bound(rig, "app=pair") == pods  # nothing evicted against the budget
        assert node_events(rig, node, "GPUReset") == []  # and no reset under a pod
        refused_at = time.monotonic()
        rig.cp.admin.request("PATCH", f"{PDBS}/pair", body={"spec": {"minAvailable": 1}},
                             content_type="application/merge-patch+json")  # fmt: skip
        try:
            [event] = wait_for(lambda: node_events(rig, node, "GPUReset"), 90,
                               what="the GPUReset Event on the Node")  # fmt: skip
        except AssertionError as e:
            raise AssertionError(f"{e}\n{rig.rebalancer_log('reset')[-4000:]}") from None
        back_at = time.monotonic()
        wait_for(lambda: rig.cp.node(node)["metadata"]["labels"].get(P + "gpu.healthy") == "8",
                 30, what="8 healthy GPUs again")  # fmt: skip
        wait_for(lambda: condition(rig, node).get("status") == "True", 30,
                 what="GPUHealthy True again")  # fmt: skip
        uuid = verdicts(rig, node)[sick_gpu]["uuid"]
        assert event["type"] == "Normal"
        assert f"GPU {sick_gpu} ({uuid}) reset and back in service" in event["message"]
        assert "recovery gpu_reset cleared" in event["message"]
        assert agent_metric(rig, node, "gpudaemon_gpu_resets_total", gpu=str(sick_gpu),
                            uuid=uuid, result="success") == 1  # fmt: skip
        assert metric(url, RESETS, result="granted") == 1
        assert P + "gpu-reset" not in (rig.cp.node(node)["metadata"].get("annotations") or {})
        assert first not in bound(rig, "app=pair")  # the sick GPU's pod went
        assert bound(rig, "app=pair")[second] == node  # the other one never moved
        assert second not in watch.terminating  # never evicted, never deleted
        assert not watch.cordoned
    finally:
        watch.close()
    # Fault to back in service with the default settings (the pods end at once here:
    # terminationGracePeriodSeconds 0; the PDB was relaxed as soon as it refused).
    print(
        f"\nfault -> first eviction request (refused by the PDB): {refused_at - t0:.1f} s; "
        f"-> GPU back in service: {back_at - t0:.1f} s; capacity lost: GPU {sick_gpu} only"
    )
    rig.stop_rebalancers()
    rig.delete(f"/apis/apps/v1/namespaces/{NS}/deployments/pair")
    rig.delete(f"{PDBS}/pair")


def test_what_a_reset_cannot_fix_is_never_reset_or_escalates(rig: RebalanceRig) -> None:
    grant_agents_events(rig)
    profile = idle_profile(rig)
    node = "esc-a"
    rem = {**REMEDIATION, "settle_s": 1, "max_unhealthy_fraction": 1.0}  # 2 of 8 GPUs sick
    rig.add_node(node, "esc")
    rig.live_agent(node, simulate=profile, remediation=rem, health={"state_file": "auto"})
    rig.wait_extender_sees([node])
    rig.deployment("crew", 3, 1, "esc")
    pods = wait_for(lambda: (b := bound(rig, "app=crew")) and len(b) == 3 and b, 60,
                    what="three pods bound")  # fmt: skip
    assert set(pods.values()) == {node}
    names = sorted(pods)
    gpus = {n: wait_for(lambda n=n: holding(rig, node, n), 30, what=f"{n}'s GPU")[0]
            for n in names}  # fmt: skip
    free = sorted(set(range(8)) - set(gpus.values()))
    backend = rig.agents[node].backend
    assert isinstance(backend, SimulatedBackend)
    url = rig.start_rebalancer("esc", apply=True, remediation=rem)

    # A remap failure needs the GPU replaced: never reset. A persistent fault: reset
    # max_attempts (2) times, then reboot_node.
    backend.inject(free[0], FaultSpec(kind="row_remap", failure=True))
    backend.inject(free[1], FaultSpec(kind="xid", xid=48, persistent=True))
    wait_for(lambda: verdicts(rig, node)[free[0]].get("action") == "replace", 30,
             what="the remap failure's verdict: replace")  # fmt: skip
    try:
        [failed] = wait_for(lambda: node_events(rig, node, "GPUResetFailed"), 120,
                            what="GPUResetFailed after two resets")  # fmt: skip
    except AssertionError as e:
        raise AssertionError(f"{e}\n{rig.rebalancer_log('esc')[-4000:]}") from None
    v = verdicts(rig, node)[free[1]]
    assert (v["state"], v["action"]) == ("unhealthy", "reboot_node")
    assert "2 reset(s) in 24 h did not fix it" in v["reason"]
    assert "reboot_node" in failed["message"] and failed["type"] == "Warning"
    assert "did not fix" in (condition(rig, node).get("message") or "")
    uuid = v["uuid"]
    assert agent_metric(rig, node, "gpudaemon_gpu_resets_total", gpu=str(free[1]), uuid=uuid,
                        result="failed") == 2  # fmt: skip
    assert agent_metric(rig, node, "gpudaemon_gpu_reset_escalated", gpu=str(free[1]),
                        uuid=uuid) == 1  # fmt: skip
    replace_uuid = verdicts(rig, node)[free[0]]["uuid"]
    for result in ("success", "failed", "skipped_busy", "blocked"):
        assert agent_metric(rig, node, "gpudaemon_gpu_resets_total", gpu=str(free[0]),
                            uuid=replace_uuid, result=result) == 0  # fmt: skip
    assert scrape(url + "/metrics", RESETS, result="granted") == 2

    # The escalated GPU needs a reboot, but nothing reboots the node yet: the three pods
    # on its healthy GPUs keep running.
    time.sleep(4)  # a negative check: time for a drain that must not come
    assert bound(rig, "app=crew") == pods
    # Whatever reboots it cordons it first: now they go, through the Eviction API.
    rig.cp.admin.request("PATCH", f"/api/v1/nodes/{node}", body={"spec": {"unschedulable": True}},
                         content_type="application/merge-patch+json")  # fmt: skip
    wait_for(lambda: metric(url, DRAINS, action="reboot_node", result="done") >= 3, 60,
             what="the node's GPU pods drained once it is cordoned")  # fmt: skip
    rig.stop_rebalancers()
    rig.delete(f"/apis/apps/v1/namespaces/{NS}/deployments/crew")


class GrantWatcher:
    """The most Nodes seen holding a reset grant at once, polling every 0.1 s."""

    def __init__(self, rig: RebalanceRig, nodes: list[str]) -> None:
        self.rig, self.nodes = rig, nodes
        self.most = 0
        self.ever: set[str] = set()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(0.1):
            try:
                held = {n for n in self.nodes
                        if P + "gpu-reset" in (self.rig.cp.node(n)["metadata"].get("annotations") or {})}  # fmt: skip
            except Exception:  # a poll that fails is retried
                continue
            self.ever |= held
            self.most = max(self.most, len(held))

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)


def test_the_fleet_limit_and_the_circuit_breaker_hold_resets_back(rig: RebalanceRig) -> None:
    """Three nodes each with a GPU asking for a reset, max_concurrent 1: one grant at a
    time, all three reset in turn. Then, with the circuit breaker's share set below what
    just happened, a new fault gets no grant at all."""
    grant_agents_events(rig)
    profile = idle_profile(rig)
    nodes = ["conc-a", "conc-b", "conc-c"]
    agent_rem = {"reset_gpu": True, "settle_s": 4}
    for n in nodes:
        rig.add_node(n, "conc")
        rig.live_agent(n, simulate=profile, remediation=agent_rem, health={"state_file": "auto"})
    rig.wait_extender_sees(nodes)
    rem = {"reset_gpu": True, "max_concurrent": 1, "max_unhealthy_fraction": 1.0}
    url = rig.start_rebalancer("conc", apply=True, remediation=rem)
    watch = GrantWatcher(rig, nodes)
    try:
        for n in nodes:
            backend = rig.agents[n].backend
            assert isinstance(backend, SimulatedBackend)
            backend.inject(0, FaultSpec(kind="recovery_action", action="gpu_reset"))
        try:
            wait_for(lambda: all(node_events(rig, n, "GPUReset") for n in nodes), 120,
                     what="each node's GPU reset in turn")  # fmt: skip
        except AssertionError as e:
            raise AssertionError(f"{e}\n{rig.rebalancer_log('conc')[-4000:]}") from None
        assert watch.most == 1 and watch.ever == set(nodes)
        assert metric(url, RESETS, result="granted") == 3
        assert metric(url, RESETS, result="concurrency") >= 1  # the others were held back
    finally:
        watch.close()
    rig.stop_rebalancers()

    # The breaker: three GPUs of the fleet turned unhealthy within window_s; with the
    # share set below that, a new fault waits, counted and shown, with no grant.
    rem = {"reset_gpu": True, "max_unhealthy_fraction": 0.01, "window_s": 3600}
    url = rig.start_rebalancer("breaker", apply=True, remediation=rem)
    watch = GrantWatcher(rig, nodes)
    try:
        backend = rig.agents["conc-a"].backend
        assert isinstance(backend, SimulatedBackend)
        backend.inject(1, FaultSpec(kind="recovery_action", action="gpu_reset"))
        wait_for(lambda: metric(url, "gpudaemon_rebalancer_reset_breaker_open") == 1, 60,
                 what="the circuit breaker open")  # fmt: skip
        passes = metric(url, "gpudaemon_rebalancer_passes_total")
        wait_for(lambda: metric(url, "gpudaemon_rebalancer_passes_total") >= passes + 8, 60,
                 what="eight more passes")  # fmt: skip
        assert watch.ever == set() and metric(url, RESETS, result="granted") == 0
        assert metric(url, RESETS, result="breaker_open") >= 1
        assert len(node_events(rig, "conc-a", "GPUReset")) == 1  # the first one only
    finally:
        watch.close()
    rig.stop_rebalancers()
