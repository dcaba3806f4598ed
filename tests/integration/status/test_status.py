"""`gpudaemon status` against a real API server with four nodes run by real simulated
agents (issue 18): one with a lost GPU and a degraded one (a clock slowdown: issue 30's
state and action per GPU), one whose agent was stopped, GPU pods bound on two. Total, healthy, allocated, free and fresh per node are checked in the JSON, and the
table shows the same numbers; the stopped agent's node shows its health as unknown and
says why (issue 28). A release in another namespace: `status -n <namespace>` shows its
agents' nodes fresh, `status` alone finds their Leases by label, and a node without an
agent shows no healthy GPUs."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.kube.conftest import control_plane as control_plane
from tests.integration.kube.controlplane import ControlPlane
from tests.support import run_cli, start_agent, stop, wait_for

pytestmark = pytest.mark.integration

LOST_GPU5 = """driver_version: "550.54.15"
cuda_version: "12.4"
gpus:
  - {name: NVIDIA H100 80GB HBM3, memory_total_mib: 81559, compute_capability: "9.0", count: 8}
faults: [{kind: lost, gpu: 5}, {kind: clock_event, gpu: 2, reasons: [hw_slowdown]}]
"""


def bound_pod(cp: ControlPlane, node: str, gpus: int) -> None:
    cp.admin.request(
        "POST",
        "/api/v1/namespaces/default/pods",
        body={
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"{node}-{uuid.uuid4().hex[:6]}"},
            "spec": {
                "nodeName": node,
                "containers": [
                    {
                        "name": "c",
                        "image": "example.invalid/x",
                        "resources": {"limits": {"nvidia.com/gpu": str(gpus)}},
                    }
                ],
            },
        },
    )


@pytest.fixture
def fleet(control_plane: ControlPlane, tmp_path: Path) -> Iterator[dict[str, Any]]:
    cp = control_plane
    tag = uuid.uuid4().hex[:6]
    names = {k: f"st-{tag}-{k}" for k in ("busy", "lost", "stopped", "idle")}
    (tmp_path / "profile-lost.yaml").write_text(LOST_GPU5)
    procs = {}
    for kind, node in names.items():
        cp.create_node(node, {"status-test": tag})
        cfg = tmp_path / f"{kind}.yaml"
        cfg.write_text(
            f"node_name: {node}\n"
            f"simulate: {tmp_path / 'profile-lost.yaml' if kind == 'lost' else 'dgx-h100'}\n"
            "metrics: {listen: '127.0.0.1:0'}\n"
            "labels: {to: apiserver}\n"
            f"kubernetes: {{kubeconfig: '{cp.agent_kubeconfig}', lease_duration_seconds: 10}}\n"
            "schedules: {telemetry: '* * * * * *', labels: '*/2 * * * * *'}\n"
        )
        procs[kind] = start_agent(["run", "--config", str(cfg)], log=tmp_path / f"{kind}.log")
    try:
        for kind, node in names.items():
            wait_for(lambda n=node: cp.lease(n), timeout=60, what=f"{kind} agent's Lease")
        wait_for(
            lambda: (
                cp.node(names["lost"])["metadata"]["labels"].get("gpudaemon.io/gpu.healthy") == "7"
            ),
            timeout=60,
            what="the lost GPU in the labels",
        )
        bound_pod(cp, names["busy"], 3)
        bound_pod(cp, names["busy"], 1)
        bound_pod(cp, names["lost"], 2)
        sigterm_at = time.monotonic()
        stop(procs["stopped"])
        yield {"tag": tag, "names": names, "cp": cp, "sigterm_at": sigterm_at}
    finally:
        for p in procs.values():
            stop(p)


def status(cp: ControlPlane, *args: str) -> Any:
    p = run_cli("status", "--kubeconfig", str(cp.admin_kubeconfig), *args)
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_status_gives_the_right_numbers_per_node(fleet: dict[str, Any]) -> None:
    cp, names, tag = fleet["cp"], fleet["names"], fleet["tag"]

    def stale() -> Any:
        out = json.loads(status(cp, "-o", "json", "-l", f"status-test={tag}"))
        rows = {r["name"]: r for r in out["nodes"]}
        return out if not rows[names["stopped"]]["fresh"] else None

    # A graceful stop releases the Lease: FRESH reads no within 5 s of the SIGTERM, not
    # when the 10 s Lease would have run out (360 s with the chart's default).
    out = wait_for(stale, timeout=30, interval=0.2, what="the stopped agent's Lease released")
    assert time.monotonic() - fleet["sigterm_at"] <= 5.0
    rows = {r["name"]: r for r in out["nodes"]}
    assert set(rows) == set(names.values())
    got = {
        k: (rows[n]["total"], rows[n]["healthy"], rows[n]["allocated"], rows[n]["free"],
            rows[n]["fresh"])
        for k, n in names.items()
    }  # fmt: skip
    assert got == {
        "busy": (8, 8, 4, 4, True),
        "lost": (8, 7, 2, 5, True),  # the lost GPU is neither free nor healthy
        "stopped": (8, None, 0, None, False),  # no fresh data: unknown, not healthy
        "idle": (8, 8, 0, 8, True),
    }
    assert rows[names["lost"]]["unhealthy"] == [
        {"index": 5, "reason": "gpu lost", "state": "unhealthy", "action": "reboot_node"}
    ]
    # Degraded: schedulable (among the healthy and free), but shown with its action.
    assert rows[names["lost"]]["degraded"] == [
        {"index": 2, "reason": "clock event hw_slowdown", "state": "degraded", "action": "watch"}
    ]
    assert rows[names["idle"]]["degraded"] == [] and rows[names["stopped"]]["degraded"] is None
    assert rows[names["busy"]]["product"] == "NVIDIA-H100-80GB-HBM3"
    assert rows[names["idle"]]["age_s"] < 10
    assert rows[names["stopped"]]["stale_reason"].startswith(
        "the agent stopped (released its Lease) "
    )
    assert rows[names["idle"]]["stale_reason"] is None
    (summary,) = out["summary"]
    assert (summary["nodes"], summary["stale_nodes"], summary["total"]) == (4, 1, 32)
    assert (summary["healthy"], summary["allocated"], summary["free"]) == (23, 6, 17)
    assert summary["degraded"] == 1

    table = status(cp, "-l", f"status-test={tag}")
    lines = {ln.split()[0]: ln.split() for ln in table.splitlines() if ln.startswith("st-")}
    for k, n in names.items():
        total, healthy, allocated, free, fresh = got[k]
        assert lines[n][2:7] == [str(total), "-" if healthy is None else str(healthy),
                                 str(allocated), "-" if free is None else str(free),
                                 "yes" if fresh else "NO"]  # fmt: skip
    assert lines[names["lost"]][8] == "2=degraded/watch,5=unhealthy/reboot_node"
    assert lines[names["idle"]][8] == "-"
    assert "5: gpu lost" in table
    assert "stale: the agent stopped (released its Lease) " in table

    # A cordoned node and a NotReady one offer nothing, whatever their GPUs are.
    cp.admin.request("PATCH", f"/api/v1/nodes/{names['idle']}",
                     body={"spec": {"unschedulable": True}},
                     content_type="application/merge-patch+json")  # fmt: skip
    cp.admin.request("PATCH", f"/api/v1/nodes/{names['busy']}/status",
                     body={"status": {"conditions": [{"type": "Ready", "status": "Unknown",
                                                       "reason": "NodeStatusUnknown"}]}},
                     content_type="application/strategic-merge-patch+json")  # fmt: skip
    out = json.loads(status(cp, "-o", "json", "-l", f"status-test={tag}"))
    rows = {r["name"]: r for r in out["nodes"]}
    assert (rows[names["idle"]]["free"], rows[names["idle"]]["unavailable"]) == (0, "cordoned")
    assert (rows[names["busy"]]["free"], rows[names["busy"]]["unavailable"]) == (
        0, "NotReady (NodeStatusUnknown)")  # fmt: skip
    assert out["summary"][0]["free"] == 5  # the lost GPUs' node only
    table = status(cp, "-l", f"status-test={tag}")
    lines = {ln.split()[0]: ln for ln in table.splitlines() if ln.startswith("st-")}
    assert lines[names["idle"]].split()[5] == "0" and "cordoned: 0 free" in lines[names["idle"]]
    assert "NotReady (NodeStatusUnknown): 0 free" in lines[names["busy"]]


def test_status_without_a_kubeconfig_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBECONFIG", "/nonexistent")
    monkeypatch.setenv("HOME", "/nonexistent")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    p = run_cli("status")
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr


AGENT = """node_name: {node}
simulate: dgx-h100
metrics: {{listen: '127.0.0.1:0'}}
labels: {{to: apiserver}}
kubernetes: {{kubeconfig: '{kubeconfig}', lease_namespace: {namespace}}}
schedules: {{labels: '*/2 * * * * *'}}
"""


def test_status_finds_a_release_in_another_namespace(
    control_plane: ControlPlane, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Done-when 5 of issue 28: every node showed stale when the chart ran in another
    namespace, and a node with no agent showed HEALTHY 8, FREE 8."""
    cp = control_plane
    tag = uuid.uuid4().hex[:6]
    ns = f"gpu-ops-{tag}"
    cp.admin.request("POST", "/api/v1/namespaces",
                     body={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})  # fmt: skip
    names = [f"ns-{tag}-{i}" for i in range(3)]  # the last one runs no agent
    for n in names:
        cp.create_node(n, {"status-ns-test": tag})
    procs = []
    try:
        for n in names[:2]:
            cfg = tmp_path / f"{n}.yaml"
            # The admin's kubeconfig: the agents' RBAC in the test's manifests is for
            # the namespace gpudaemon; what is under test is where status looks.
            cfg.write_text(AGENT.format(node=n, kubeconfig=cp.admin_kubeconfig, namespace=ns))
            procs.append(start_agent(["run", "--config", str(cfg)], log=tmp_path / f"{n}.log"))
        for n in names[:2]:
            wait_for(lambda n=n: cp.lease(n, ns), timeout=60, what=f"{n}'s Lease in {ns}")
        monkeypatch.delenv("GPUDAEMON_KUBERNETES__LEASE_NAMESPACE", raising=False)

        def rows(*args: str) -> dict[str, Any]:
            out = json.loads(status(cp, "-o", "json", "-l", f"status-ns-test={tag}", *args))
            return {r["name"]: r for r in out["nodes"]}

        for args in (["-n", ns], ["--namespace", ns], []):  # [] : found by the Leases' label
            got = rows(*args)
            for n in names[:2]:
                assert (got[n]["fresh"], got[n]["healthy"], got[n]["free"]) == (True, 8, 8), args
            no_agent = got[names[2]]
            assert (no_agent["fresh"], no_agent["healthy"], no_agent["free"]) == (
                False, None, None)  # fmt: skip
            assert no_agent["stale_reason"].startswith("no agent Lease in namespace"), no_agent
            assert ns in no_agent["stale_reason"]
        line = next(ln for ln in status(cp, "-n", ns).splitlines() if ln.startswith(names[2]))
        assert line.split()[2:7] == ["8", "-", "0", "-", "NO"], line
        # The chart's default namespace holds none of this release's Leases.
        wrong = rows("-n", "gpudaemon")
        assert not any(r["fresh"] for r in wrong.values())
        assert wrong[names[0]]["stale_reason"] == "no agent Lease in namespace gpudaemon"
    finally:
        for p in procs:
            stop(p)
