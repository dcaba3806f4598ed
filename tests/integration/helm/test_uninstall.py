"""Uninstall leaves the cluster as it was; a restart and an upgrade keep a quarantine.

On the real kube-apiserver, kube-controller-manager and kube-scheduler, with only what
the chart gives (a release with DRA, the rebalancer and the node taint on): the agent,
run with a token bound to the release's agent pod and the chart's config, quarantines a
GPU after XID 79 (labels, the fault record, the GPUHealthy condition, the taint, a
DeviceTaintRule, its Lease). SIGTERM, `helm upgrade` (new agent pods, a new config) and
an agent started again with a profile whose XID is gone leave every part of the
quarantine in place, and no cleanup runs. Then `helm uninstall`: its post-delete Job
(run as its pod would, hooks.py) removes every label, annotation, condition, taint,
DeviceTaintRule and Lease gpudaemon wrote, and the rebalancer's reservation notes, and
leaves what others wrote on the same Nodes and pods alone.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import pytest

from gpudaemon.agent.nodesync import owned_keys
from gpudaemon.backends.simulated import SimulatedBackend, load_profile
from gpudaemon.errors import KubeNotFoundError
from tests.integration.helm.cluster import Cluster
from tests.integration.helm.conftest import CHART, IMAGE, agent_pods, run_helm
from tests.integration.helm.hooks import uninstall
from tests.integration.helm.test_chart_identities import chart_config, clean_env
from tests.integration.helm.test_dra_agent import (
    DRIVER,
    NODE,
    RULES,
    SLICES,
    publish_slice,
    write_profile,
)
from tests.integration.helm.test_least_privilege import pod_bound_token
from tests.integration.kube.controlplane import _kubeconfig
from tests.support import free_port, start_agent, stop

pytestmark = [pytest.mark.integration, pytest.mark.parametrize("helm", ["helm"], indirect=True)]

REL, NS = "clean", "gpudaemon-clean"
PREFIX = "gpudaemon.io/"
TAINT = PREFIX + "gpu-unhealthy"
OUR_RULES = "app.kubernetes.io/name=gpudaemon,app.kubernetes.io/component=device-taint"
LEASES = f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases"
THEIRS = {"example.com/team": "vision"}
THEIR_TAINT = {"key": "example.com/maintenance", "effect": "PreferNoSchedule"}
NOTE_POD = "/api/v1/namespaces/default/pods/reserved-for"


def live_agent_pod(cluster: Cluster, node: str) -> dict[str, Any]:
    def live() -> dict[str, Any] | None:
        cluster.finish_deletions(NS)
        return next(
            (
                p
                for p in agent_pods(cluster, NS, REL)
                if p["spec"].get("nodeName") == node and not p["metadata"].get("deletionTimestamp")
            ),
            None,
        )

    return dict(cluster.wait(live, f"a live agent pod on {node}", timeout=120))


def quarantine(cluster: Cluster) -> dict[str, Any]:
    """Every part of the quarantine of GPU 3 on NODE, as the API server has it."""
    node = cluster.request("GET", f"/api/v1/nodes/{NODE}")
    meta = node["metadata"]
    cond = next(
        (c for c in node["status"].get("conditions") or [] if c["type"] == "GPUHealthy"), {}
    )
    return {
        "unhealthy": meta["labels"].get(PREFIX + "gpu.unhealthy"),
        "healthy": meta["labels"].get(PREFIX + "gpu.healthy"),
        "faults": PREFIX + "gpu-faults" in meta.get("annotations", {}),
        "condition": (cond.get("status"), cond.get("reason")),
        "taint": any(t["key"] == TAINT for t in node["spec"].get("taints") or []),
        "rules": sorted(
            r["spec"]["deviceSelector"]["device"]
            for r in cluster.items(RULES, f"{OUR_RULES},{PREFIX}node={NODE}")
        ),
    }


QUARANTINED = {
    "unhealthy": "1",
    "healthy": "7",
    "faults": True,
    "condition": ("False", "GPUUnhealthy"),
    "taint": True,
    "rules": ["gpu-3"],
}


def holder(cluster: Cluster) -> str:
    lease = cluster.get(f"{LEASES}/{NODE}") or {}
    return str((lease.get("spec") or {}).get("holderIdentity") or "")


def ours_left(cluster: Cluster) -> list[str]:
    """Whatever gpudaemon wrote that is still in the cluster."""
    out = []
    for node in cluster.items("/api/v1/nodes"):
        name = node["metadata"]["name"]
        meta = node["metadata"]
        out += [f"node {name}: label {k}" for k in meta.get("labels") or {}
                if k.startswith(PREFIX)]  # fmt: skip
        out += [f"node {name}: annotation {k}" for k in meta.get("annotations") or {}
                if k.startswith(PREFIX)]  # fmt: skip
        labels, ann = owned_keys(node)
        out += [f"node {name}: owns {k}" for k in labels | ann]
        out += [f"node {name}: condition GPUHealthy"
                for c in node["status"].get("conditions") or [] if c["type"] == "GPUHealthy"]  # fmt: skip
        out += [f"node {name}: taint {TAINT}"
                for t in node["spec"].get("taints") or [] if t["key"] == TAINT]  # fmt: skip
    out += [f"DeviceTaintRule {r['metadata']['name']}" for r in cluster.items(RULES, OUR_RULES)]
    out += [f"Lease {x['metadata']['name']}" for x in cluster.items(LEASES)]
    note = cluster.get(NOTE_POD) or {"metadata": {}}
    out += [f"pod note {k}" for k in note["metadata"].get("annotations") or {}
            if k.startswith("gpudaemon.io/reserved")]  # fmt: skip
    return out


def test_uninstall_removes_everything_ours_and_restart_or_upgrade_keeps_a_quarantine(
    helm: str, cluster: Cluster, tmp_path: Path
) -> None:
    kc = cluster.kubeconfig
    proc = run_helm(
        helm, "install", REL, str(CHART), "-n", NS, "--create-namespace", *IMAGE,
        "--set", "dra.enabled=true", "--set", "rebalancer.enabled=true",
        "--set", "agent.taintUnhealthy=true", kubeconfig=kc,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    profile = write_profile(tmp_path / "h100.yaml", "boot-1", xid=True)
    gpus = SimulatedBackend(load_profile(str(profile))).inventory().gpus
    publish_slice(cluster, [g.uuid for g in sorted(gpus, key=lambda g: g.index)])
    # What others wrote on the same Node: it must survive the uninstall.
    cluster.request("PATCH", f"/api/v1/nodes/{NODE}", body={"metadata": {"labels": THEIRS}},
                    content_type="application/merge-patch+json")  # fmt: skip
    node = cluster.request("GET", f"/api/v1/nodes/{NODE}")
    cluster.request("PATCH", f"/api/v1/nodes/{NODE}",
                    body={"spec": {"taints": [*(node["spec"].get("taints") or []), THEIR_TAINT]}},
                    content_type="application/merge-patch+json")  # fmt: skip

    def run_agent(log: str) -> Any:
        token = pod_bound_token(cluster, NS, live_agent_pod(cluster, NODE))
        agent_kc = _kubeconfig(tmp_path / f"{log}.kc", cluster.cp.server, "agent", token,
                               cluster.cp.ca)  # fmt: skip
        cfg = chart_config(cluster, NS, f"{REL}-gpudaemon-agent", tmp_path / f"{log}.yaml")
        return start_agent(
            ["run", "--config", str(cfg), "--simulate", str(profile)],
            env=clean_env(NODE_NAME=NODE, GPUDAEMON_KUBERNETES__KUBECONFIG=str(agent_kc),
                          GPUDAEMON_METRICS__LISTEN=f"127.0.0.1:{free_port()}",
                          GPUDAEMON_METRICS__POD_RESOURCES_SOCKET=""),
            log=tmp_path / log,
        )  # fmt: skip

    agent = run_agent("agent-1.log")
    try:
        cluster.wait(lambda: quarantine(cluster) == QUARANTINED, "GPU 3 quarantined", 120)
        first = holder(cluster)
        assert first
    finally:
        assert stop(agent) == 0
    # A stop is not an uninstall: the quarantine stays whole.
    time.sleep(2)  # a negative check: time for a cleanup that must not come
    assert quarantine(cluster) == QUARANTINED

    proc = run_helm(
        helm, "upgrade", REL, str(CHART), "-n", NS, "--reuse-values",
        "--set", "agent.config.schedules.telemetry=*/2 * * * * *", kubeconfig=kc,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not cluster.items(f"/apis/batch/v1/namespaces/{NS}/jobs"), "a cleanup ran on upgrade"
    assert quarantine(cluster) == QUARANTINED

    # The upgraded agent, whose GPU no longer reports the XID: the fault record keeps
    # GPU 3 unhealthy until a repair (a new boot ID).
    write_profile(profile, "boot-1", xid=False)
    agent = run_agent("agent-2.log")
    try:
        cluster.wait(lambda: holder(cluster) not in ("", first), "the new agent's Lease", 90)
        time.sleep(3)  # a reconcile after its first: nothing lifted meanwhile
        assert quarantine(cluster) == QUARANTINED
    finally:
        assert stop(agent) == 0
    assert quarantine(cluster) == QUARANTINED

    # The rebalancer's Lease and a reservation note, as its leader writes them.
    cluster.request("POST", LEASES, body={
        "metadata": {"name": "gpudaemon-rebalancer"},
        "spec": {"holderIdentity": "rebalancer-0", "leaseDurationSeconds": 15},
    })  # fmt: skip
    cluster.request("POST", "/api/v1/namespaces/default/pods", body={
        "metadata": {"name": "reserved-for", "annotations": {
            "gpudaemon.io/reserved-node": NODE, "gpudaemon.io/reserved-until": "1",
            "example.com/keep": "yes"}},
        "spec": {"containers": [{"name": "c", "image": "example.invalid/train"}],
                 "nodeSelector": {"example.com/none": "x"}},
    })  # fmt: skip
    try:
        assert len(ours_left(cluster)) > 5

        done, output = uninstall(helm, cluster, REL, NS, tmp_path / "uninstall")
        assert done.returncode == 0, done.stdout + done.stderr + output
        assert "0 failed" in output, output
        assert ours_left(cluster) == [], output
        node = cluster.request("GET", f"/api/v1/nodes/{NODE}")
        assert node["metadata"]["labels"]["example.com/team"] == "vision"
        assert THEIR_TAINT in node["spec"]["taints"]
        pod = cluster.request("GET", NOTE_POD)
        assert pod["metadata"]["annotations"] == {"example.com/keep": "yes"}
        # The hook's own objects are gone too.
        assert not cluster.items(f"/apis/batch/v1/namespaces/{NS}/jobs")
        assert not cluster.items("/apis/rbac.authorization.k8s.io/v1/clusterroles",
                                 f"app.kubernetes.io/instance={REL}")  # fmt: skip
    finally:
        for path in (NOTE_POD, f"{SLICES}/{NODE}-{DRIVER}-test"):
            with contextlib.suppress(KubeNotFoundError):
                cluster.request("DELETE", path, query={"gracePeriodSeconds": "0"})
        node = cluster.request("GET", f"/api/v1/nodes/{NODE}")
        taints = [t for t in node["spec"].get("taints") or [] if t["key"] != THEIR_TAINT["key"]]
        cluster.request("PATCH", f"/api/v1/nodes/{NODE}",
                        body={"metadata": {"labels": {"example.com/team": None}},
                              "spec": {"taints": taints or None}},
                        content_type="application/merge-patch+json")  # fmt: skip
