"""GPU health where kubectl and the default scheduler see it (issue 17), against the real
API server with the shipped RBAC and admission policy, as the agent's identity: the
`gpu.unhealthy` label, the `GPUHealthy` condition written only on change (its message
naming each GPU's state, reason and action, issue 30; degraded GPUs keep it True), and
the opt-in taint the agent may add and remove, and nothing else of the spec or status."""

from __future__ import annotations

from typing import Any

import pytest

from gpudaemon.agent.nodehealth import NodeHealthWriter
from gpudaemon.errors import KubeError
from gpudaemon.kube.client import KubeClient
from gpudaemon.labels import GpuHealth
from tests.integration.kube.controlplane import ControlPlane

pytestmark = pytest.mark.integration

MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
TAINT = "gpudaemon.io/gpu-unhealthy"


def condition(node: dict[str, Any]) -> dict[str, Any] | None:
    conds = (node.get("status") or {}).get("conditions") or []
    return next((c for c in conds if c["type"] == "GPUHealthy"), None)


def refused(call: Any) -> str:
    with pytest.raises(KubeError) as e:
        call()
    assert e.value.status in (403, 422), e.value
    return str(e.value)


def test_condition_and_opt_in_taint_as_the_agent(control_plane: ControlPlane, node: str) -> None:
    agent = control_plane.as_agent()
    admin = control_plane.admin
    # Someone else's taint and condition, which the agent must keep.
    admin.request("PATCH", f"/api/v1/nodes/{node}", body={"spec": {"taints": [
        {"key": "dedicated", "value": "ml", "effect": "NoSchedule"}]}}, content_type=MERGE)  # fmt: skip
    admin.request("PATCH", f"/api/v1/nodes/{node}/status", body={"status": {"conditions": [
        {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "ok"}]}},
        content_type=STRATEGIC)  # fmt: skip

    w = NodeHealthWriter(agent, node, "gpudaemon.io/", taint=True)
    xid = GpuHealth(3, "xid 79", "unhealthy", "reboot_node")
    assert w.sync([xid], 8) is True
    got = control_plane.node(node)
    c = condition(got)
    assert c is not None and (c["status"], c["reason"]) == ("False", "GPUUnhealthy")
    assert c["message"] == "1 of 8 GPU(s) unhealthy: GPU 3: xid 79 (unhealthy, action reboot_node)"
    assert {t["key"] for t in got["spec"]["taints"]} == {"dedicated", TAINT}
    rv = got["metadata"]["resourceVersion"]
    assert w.sync([xid], 8) is False  # no change: no write
    assert control_plane.node(node)["metadata"]["resourceVersion"] == rv

    # Degraded only: schedulable, so True (the policy allows the new reason) and untainted.
    slow = GpuHealth(2, "clock event hw_thermal", "degraded", "watch")
    assert w.sync([slow], 8) is True
    got = control_plane.node(node)
    c = condition(got)
    assert c is not None and (c["status"], c["reason"]) == ("True", "GPUDegraded")
    assert "GPU 2: clock event hw_thermal (degraded, action watch)" in c["message"]
    assert [t["key"] for t in got["spec"]["taints"]] == ["dedicated"]

    assert w.sync([], 8) is True  # repaired
    got = control_plane.node(node)
    assert condition(got)["status"] == "True"  # type: ignore[index]
    assert [t["key"] for t in got["spec"]["taints"]] == ["dedicated"]
    ready = [x for x in got["status"]["conditions"] if x["type"] == "Ready"]
    assert ready and ready[0]["reason"] == "KubeletReady"


def test_the_policy_allows_the_agent_no_other_taint_or_status_change(
    control_plane: ControlPlane, node: str
) -> None:
    agent: KubeClient = control_plane.as_agent()
    path = f"/api/v1/nodes/{node}"
    msg = refused(lambda: agent.request("PATCH", path, body={"spec": {"taints": [
        {"key": "evil", "effect": "NoExecute"}]}}, content_type=MERGE))  # fmt: skip
    assert "except to add or remove its own taint" in msg
    refused(lambda: agent.request("PATCH", path, body={"spec": {"taints": [
        {"key": TAINT, "effect": "NoExecute"}]}}, content_type=MERGE))  # fmt: skip
    refused(lambda: agent.request("PATCH", path, body={"spec": {"unschedulable": True}},
                                  content_type=MERGE))  # fmt: skip
    msg = refused(lambda: agent.request("PATCH", path + "/status", body={"status": {
        "conditions": [{"type": "Ready", "status": "False", "reason": "Hacked", "message": ""}]}},
        content_type=STRATEGIC))  # fmt: skip
    assert "only the GPUHealthy condition" in msg
    refused(lambda: agent.request("PATCH", path + "/status", body={"status": {
        "allocatable": {"nvidia.com/gpu": "1000"}}}, content_type=STRATEGIC))  # fmt: skip
    refused(lambda: agent.request("PATCH", path + "/status", body={"status": {
        "capacity": {"nvidia.com/gpu": "1000"}}}, content_type=STRATEGIC))  # fmt: skip
    # While the agent's own condition is fine.
    agent.patch_node(node, {"status": {"conditions": [
        {"type": "GPUHealthy", "status": "True", "reason": "AllGPUsHealthy", "message": "x"}]}},
        status=True)  # fmt: skip
    assert condition(control_plane.node(node)) is not None
