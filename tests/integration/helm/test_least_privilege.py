"""Least privilege as shipped: with the chart installed, the real agent
(`gpudaemon run --simulate dgx-h100 --once`) runs with a token of the chart's
ServiceAccount bound to the agent pod the DaemonSet put on one GPU node. It labels that
node, and the API server refuses it, with the policy's own message, on another node and
for keys outside its prefix; nor may it write another node's freshness Lease. With the
same kind of token, on a Node named like the rebalancer's Lease, it can still write its
labels, annotations and condition, but no finalizer or owner reference on the Node, and
not that Lease."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from gpudaemon.errors import KubeError, KubeForbiddenError, KubeNotFoundError
from gpudaemon.kube.client import Credentials, KubeClient
from tests.integration.helm.cluster import Cluster
from tests.integration.helm.conftest import agent_pods
from tests.integration.kube.controlplane import _kubeconfig
from tests.support import REPO

pytestmark = pytest.mark.integration


def pod_bound_token(cluster: Cluster, ns: str, pod: dict[str, Any]) -> str:
    sa = pod["spec"]["serviceAccountName"]
    tr = cluster.request(
        "POST",
        f"/api/v1/namespaces/{ns}/serviceaccounts/{sa}/token",
        body={
            "spec": {
                "expirationSeconds": 3600,
                "boundObjectRef": {
                    "kind": "Pod",
                    "apiVersion": "v1",
                    "name": pod["metadata"]["name"],
                    "uid": pod["metadata"]["uid"],
                },
            }
        },
    )
    return str(tr["status"]["token"])


def run_agent(kubeconfig: Path, node: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("GPUDAEMON_", "KUBE"))}
    return subprocess.run(
        [sys.executable, "-m", "gpudaemon", "run", "--simulate", "dgx-h100", "--once",
         "--node-name", node],
        env={**clean, "GPUDAEMON_KUBERNETES__KUBECONFIG": str(kubeconfig), **env},
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )  # fmt: skip


def labels(cluster: Cluster, node: str) -> dict[str, str]:
    return dict(cluster.request("GET", f"/api/v1/nodes/{node}")["metadata"].get("labels") or {})


def lease(cluster: Cluster, ns: str, node: str) -> dict[str, Any] | None:
    return cluster.get(f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases/{node}")


def test_agent_with_the_charts_pod_bound_token_labels_only_its_own_node(
    cluster: Cluster, release: str, tmp_path: Path
) -> None:
    pods = {str(p["spec"]["nodeName"]): p for p in agent_pods(cluster, release, "gpudaemon")}
    # Node A starts without agent data (other tests may have run agents on it); node
    # B is a CPU node, where no agent ever wrote.
    mine, other = "gpu-0", "cpu-0"
    strip = {k: None for k in labels(cluster, mine) if k.startswith("gpudaemon.io/")}
    cluster.request(
        "PATCH",
        f"/api/v1/nodes/{mine}",
        body={"metadata": {"labels": strip, "annotations": {"gpudaemon.io/gpus": None}}},
        content_type="application/merge-patch+json",
    )
    token = pod_bound_token(cluster, release, pods[mine])
    kc = _kubeconfig(
        tmp_path / "agent.kubeconfig", cluster.cp.server, "agent", token, cluster.cp.ca
    )

    ok = run_agent(kc, mine)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert labels(cluster, mine)["gpudaemon.io/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
    assert labels(cluster, mine)["gpudaemon.io/gpu.count"] == "8"
    assert lease(cluster, release, mine) is not None

    elsewhere = run_agent(kc, other)
    out = elsewhere.stdout + elsewhere.stderr
    assert elsewhere.returncode == 1, out
    assert "may change only the Node its pod runs on" in out
    assert not any(k.startswith("gpudaemon.io/") for k in labels(cluster, other))
    # The agent vouches with the Lease only after its labels were written; the same
    # token writing that Lease directly is refused by the Lease policy.
    assert lease(cluster, release, other) is None
    client = KubeClient.from_credentials(Credentials(False, str(kc)), timeout_s=30)
    try:
        with pytest.raises(KubeError) as denied:
            client.apply_lease(
                release, other, {"holderIdentity": "spoof", "leaseDurationSeconds": 40}
            )
        assert "may write only the Lease of the Node its pod runs on" in str(denied.value)
        client.apply_lease(release, mine, {"holderIdentity": "me", "leaseDurationSeconds": 40})
    finally:
        client.close()
    assert lease(cluster, release, other) is None

    foreign = run_agent(kc, mine, GPUDAEMON_LABELS__PREFIX="example.com/")
    assert foreign.returncode == 1
    assert "only labels under gpudaemon.io/" in foreign.stdout + foreign.stderr
    assert not any(k.startswith("example.com/") for k in labels(cluster, mine))


def test_charts_service_account_cannot_read_secrets_or_write_other_namespaces(
    cluster: Cluster, release: str, tmp_path: Path
) -> None:
    pod = agent_pods(cluster, release, "gpudaemon")[0]
    kc = _kubeconfig(
        tmp_path / "kc",
        cluster.cp.server,
        "agent",
        pod_bound_token(cluster, release, pod),
        cluster.cp.ca,
    )
    agent = KubeClient.from_credentials(Credentials(False, str(kc)), timeout_s=30)
    try:
        for method, path in [
            ("GET", f"/api/v1/namespaces/{release}/secrets"),
            ("GET", "/api/v1/pods"),
            ("DELETE", f"/api/v1/nodes/{pod['spec']['nodeName']}"),
            ("GET", "/apis/coordination.k8s.io/v1/namespaces/kube-system/leases"),
        ]:
            with pytest.raises(KubeForbiddenError):
                agent.request(method, path)
        agent.apply_lease(release, str(pod["spec"]["nodeName"]), {"holderIdentity": "t"})
    finally:
        agent.close()


def test_charts_agent_token_sets_no_finalizer_or_owner_and_not_the_rebalancers_lease(
    cluster: Cluster, release: str, tmp_path: Path
) -> None:
    """The attack of issue 28: an owner reference to a missing object had the garbage
    collector (running here) delete the Node, and a finalizer blocks its deletion. The
    Node is one of its own, so a broken policy costs the other tests nothing."""
    node = "gpudaemon-rebalancer"  # also the name of the rebalancer's leader Lease
    cluster.add_node(node, gpus=8)
    agent: KubeClient | None = None
    try:
        pod = cluster.wait(
            lambda: next((p for p in agent_pods(cluster, release, "gpudaemon")
                          if p["spec"].get("nodeName") == node), None),
            "the DaemonSet's agent pod on the new node",
        )  # fmt: skip
        token = pod_bound_token(cluster, release, pod)
        kc = _kubeconfig(tmp_path / "kc", cluster.cp.server, "agent", token, cluster.cp.ca)
        agent = KubeClient.from_credentials(Credentials(False, str(kc)), timeout_s=30)

        # A policy takes effect asynchronously: wait until the metadata rule bites
        # (while it does not, undo what got through and try again).
        def refused() -> bool:
            try:
                agent_client.patch_node(node, {"metadata": {"finalizers": ["example.com/p"]}})
            except KubeError as e:
                return "of a Node's metadata" in str(e)
            cluster.request("PATCH", f"/api/v1/nodes/{node}", body={"metadata": {"finalizers": None}},
                            content_type="application/merge-patch+json")  # fmt: skip
            return False

        agent_client = agent
        cluster.wait(refused, "the agent's metadata rule in force", timeout=60)

        # What the agent writes, as it writes it, still goes through.
        agent.apply_node(node, {"gpudaemon.io/gpu.count": "8"}, {"gpudaemon.io/gpus": "[]"})
        cond = {"type": "GPUHealthy", "status": "True", "reason": "AllGPUsHealthy", "message": ""}
        agent.patch_node(node, {"status": {"conditions": [cond]}}, status=True)

        gone = {"apiVersion": "v1", "kind": "ConfigMap", "name": "gone", "uid": str(uuid.uuid4())}
        for status in (False, True):
            for meta in ({"ownerReferences": [gone]}, {"finalizers": ["example.com/hold"]}):
                with pytest.raises(KubeError) as e:
                    agent.patch_node(node, {"metadata": meta}, status=status)
                assert e.value.status == 422, e.value
                assert "may change only labels and annotations of a Node's metadata" in str(e.value)
        with pytest.raises(KubeError) as e:
            agent.apply_lease(release, node, {"holderIdentity": "spoof"})
        assert "may not write the rebalancer's Lease" in str(e.value)
        assert lease(cluster, release, node) is None

        after = cluster.request("GET", f"/api/v1/nodes/{node}")
        assert after["metadata"]["labels"]["gpudaemon.io/gpu.count"] == "8"
        assert any(c["type"] == "GPUHealthy" for c in after["status"]["conditions"])
        assert "ownerReferences" not in after["metadata"] and "finalizers" not in after["metadata"]
    finally:
        if agent is not None:
            agent.close()
        remove_node(cluster, release, node)


def remove_node(cluster: Cluster, ns: str, node: str) -> None:
    """Delete a Node the test added and the agent pod the DaemonSet put there (no
    kubelet confirms its deletion), undoing first what a broken policy let through."""
    if cluster.get(f"/api/v1/nodes/{node}"):
        cluster.request("PATCH", f"/api/v1/nodes/{node}",
                        body={"metadata": {"ownerReferences": None, "finalizers": None}},
                        content_type="application/merge-patch+json")  # fmt: skip
        cluster.request("DELETE", f"/api/v1/nodes/{node}")

    def gone() -> bool:
        left = [
            p for p in agent_pods(cluster, ns, "gpudaemon") if p["spec"].get("nodeName") == node
        ]
        for p in left:
            with contextlib.suppress(KubeNotFoundError):
                cluster.request("DELETE", f"/api/v1/namespaces/{ns}/pods/{p['metadata']['name']}",
                                query={"gracePeriodSeconds": "0"})  # fmt: skip
        return not left

    cluster.wait(gone, f"no agent pod left on {node}")
