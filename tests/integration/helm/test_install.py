"""`helm install` on a real control plane with four GPU Nodes and two CPU-only Nodes:
the real DaemonSet controller and kube-scheduler put exactly one agent on each GPU Node
and none on the others, the extender and second-scheduler Deployments get pods, and the
monitoring objects exist where their CRDs do. Then `helm upgrade` rolls a changed value
out and `helm uninstall` leaves nothing behind."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.helm.cluster import Cluster
from tests.integration.helm.conftest import (
    CHART,
    CPU_NODES,
    EVERYTHING,
    GPU_NODES,
    IMAGE,
    agent_pods,
    helm_major,
    run_helm,
)
from tests.integration.helm.hooks import uninstall

pytestmark = pytest.mark.integration


def bound(cluster: Cluster, ns: str, selector: str) -> list[str]:
    pods = cluster.items(f"/api/v1/namespaces/{ns}/pods", selector)
    return sorted(str(p["spec"].get("nodeName") or "") for p in pods)


def test_one_agent_per_gpu_node_and_none_on_cpu_nodes(cluster: Cluster, release: str) -> None:
    nodes = [str(p["spec"]["nodeName"]) for p in agent_pods(cluster, release, "gpudaemon")]
    assert sorted(nodes) == GPU_NODES
    assert not set(nodes) & set(CPU_NODES)
    ds = cluster.request("GET", f"/apis/apps/v1/namespaces/{release}/daemonsets/gpudaemon")
    assert ds["status"]["desiredNumberScheduled"] == len(GPU_NODES)


def test_scheduler_deployment_gets_a_bound_pod_with_the_extender_beside_it(
    cluster: Cluster, release: str
) -> None:
    nodes = cluster.wait(
        lambda: bound(cluster, release, "app.kubernetes.io/component=scheduler"),
        "a bound scheduler pod",
    )
    assert len(nodes) == 1 and nodes[0] in GPU_NODES + CPU_NODES, nodes
    (pod,) = cluster.items(
        f"/api/v1/namespaces/{release}/pods", "app.kubernetes.io/component=scheduler"
    )
    assert [c["name"] for c in pod["spec"]["containers"]] == ["kube-scheduler", "extender"]
    # The default layout has no extender Deployment or Service (issue 17).
    assert not bound(cluster, release, "app.kubernetes.io/component=extender")
    svcs = cluster.items(
        f"/api/v1/namespaces/{release}/services", "app.kubernetes.io/component=extender"
    )
    assert svcs == []


def test_monitoring_objects_exist_because_their_crds_do(cluster: Cluster, release: str) -> None:
    base = f"/apis/monitoring.coreos.com/v1/namespaces/{release}"
    sm = cluster.request("GET", f"{base}/servicemonitors/gpudaemon")
    assert sm["spec"]["endpoints"][0]["honorLabels"] is True
    pm = cluster.request("GET", f"{base}/podmonitors/gpudaemon-extender")
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] == "ext-metrics"
    assert pm["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "scheduler"
    rule = cluster.request("GET", f"{base}/prometheusrules/gpudaemon")
    assert {g["name"] for g in rule["spec"]["groups"]} >= {
        "gpudaemon.gpu", "gpudaemon.extender", "gpudaemon.history"
    }  # fmt: skip
    dashboards = cluster.items(f"/api/v1/namespaces/{release}/configmaps", "grafana_dashboard=1")
    assert len(dashboards) == 2


# -- a second release, for the lifecycle ----------------------------------------------

LC, LC_NS = "lc", "gpudaemon-lc"
INSTANCE = f"app.kubernetes.io/instance={LC}"


def leftovers(cluster: Cluster, rel: str = LC, ns: str = LC_NS) -> list[str]:
    """Every object of release `rel` (default `lc`) still in the API, cluster-wide."""
    paths = [
        "/apis/rbac.authorization.k8s.io/v1/clusterroles",
        "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
        "/apis/rbac.authorization.k8s.io/v1/rolebindings",
        "/apis/rbac.authorization.k8s.io/v1/roles",
        "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies",
        "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicybindings",
        "/apis/apps/v1/daemonsets",
        "/apis/apps/v1/deployments",
        "/apis/apps/v1/replicasets",
        "/apis/apps/v1/controllerrevisions",
        "/apis/batch/v1/jobs",
        "/api/v1/pods",
        "/api/v1/configmaps",
        "/api/v1/services",
        "/api/v1/serviceaccounts",
        "/apis/monitoring.coreos.com/v1/servicemonitors",
        "/apis/monitoring.coreos.com/v1/podmonitors",
        "/apis/monitoring.coreos.com/v1/prometheusrules",
        "/apis/networking.k8s.io/v1/networkpolicies",
    ]
    out = [
        f"{path.rsplit('/', 1)[1]}/{o['metadata']['name']}"
        for path in paths
        for o in cluster.items(path, f"app.kubernetes.io/instance={rel}")
    ]
    out += [
        f"secrets/{s['metadata']['name']}"
        for s in cluster.items(f"/api/v1/namespaces/{ns}/secrets", f"owner=helm,name={rel}")
    ]
    return out


def checksums(cluster: Cluster) -> dict[str, str]:
    """GPU node -> config checksum of the agent pod there (live pods only)."""
    return {
        str(p["spec"].get("nodeName")): p["metadata"]["annotations"]["checksum/config"]
        for p in agent_pods(cluster, LC_NS, LC)
        if not p["metadata"].get("deletionTimestamp")
    }


def test_upgrade_rolls_out_a_changed_value_and_uninstall_leaves_nothing(
    helm: str, cluster: Cluster, tmp_path: Path
) -> None:
    kc = cluster.kubeconfig
    proc = run_helm(
        helm, "install", LC, str(CHART), "-n", LC_NS, "--create-namespace", *IMAGE, kubeconfig=kc
    )
    assert proc.returncode == 0, proc.stderr
    before = cluster.wait(
        lambda: (c := checksums(cluster)) and sorted(c) == GPU_NODES and c, "agents bound"
    )
    assert len(set(before.values())) == 1

    proc = run_helm(
        helm, "upgrade", LC, str(CHART), "-n", LC_NS, "--reuse-values",
        "--set", "agent.config.schedules.telemetry=*/2 * * * * *", kubeconfig=kc,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    cm = cluster.request("GET", f"/api/v1/namespaces/{LC_NS}/configmaps/{LC}-gpudaemon-agent")
    config: dict[str, Any] = yaml.safe_load(cm["data"]["config.yaml"])
    assert config["schedules"]["telemetry"] == "*/2 * * * * *"

    def rolled() -> dict[str, str] | None:
        cluster.finish_deletions(LC_NS)  # what the kubelets would confirm
        c = checksums(cluster)
        done = sorted(c) == GPU_NODES and not set(c.values()) & set(before.values())
        return c if done else None

    after = cluster.wait(rolled, "every GPU node's agent replaced by the new template")
    assert len(set(after.values())) == 1

    proc, _ = uninstall(helm, cluster, LC, LC_NS, tmp_path)
    assert proc.returncode == 0, proc.stderr

    def gone() -> bool:
        cluster.finish_deletions(LC_NS)
        return not leftovers(cluster)

    try:
        cluster.wait(gone, "nothing of the release left")
    except AssertionError:
        pytest.fail(f"left behind after helm uninstall: {leftovers(cluster)}")


def test_every_switch_on_installs_and_uninstalls_leaving_nothing(
    helm: str, cluster: Cluster, tmp_path: Path
) -> None:
    """values-everything.yaml (rebalancer, InfluxDB history, monitoring, NetworkPolicy,
    TLS between scheduler and extender...) through `helm install` on the real API
    server, which validates every object, then `helm uninstall`."""
    rel, ns = "all", "gpudaemon-all"
    kc = cluster.kubeconfig
    proc = run_helm(
        helm, "install", rel, str(CHART), "-n", ns, "--create-namespace",
        "-f", str(EVERYTHING), kubeconfig=kc,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    installed = leftovers(cluster, rel, ns)
    for kind in ("daemonsets", "deployments", "servicemonitors", "prometheusrules",
                 "networkpolicies", "validatingadmissionpolicies"):  # fmt: skip
        assert any(o.startswith(f"{kind}/") for o in installed), (kind, installed)
    assert len([o for o in installed if o.startswith("deployments/")]) == 3, installed

    proc, _ = uninstall(helm, cluster, rel, ns, tmp_path)
    assert proc.returncode == 0, proc.stderr

    def gone() -> bool:
        cluster.finish_deletions(ns)
        return not leftovers(cluster, rel, ns)

    try:
        cluster.wait(gone, "nothing of the release left")
    except AssertionError:
        pytest.fail(f"left behind after helm uninstall: {leftovers(cluster, rel, ns)}")


def test_objects_applied_before_the_chart_are_adopted_as_docs_upgrade_says(
    helm: str, cluster: Cluster, tmp_path: Path
) -> None:
    """docs/upgrade.md: RBAC and policy applied by hand (as deploy/manifests/ were
    before the chart) block `helm install` until they carry helm's ownership marks."""
    rel, ns = "adopt", "gpudaemon-adopt"
    cluster.request("POST", "/api/v1/namespaces", body={"metadata": {"name": ns}})
    proc = run_helm(
        helm, "template", rel, str(CHART), "-n", ns, *IMAGE,
        "--show-only", "templates/agent/rbac.yaml",
        "--show-only", "templates/agent/admission-policy.yaml",
        "--show-only", "templates/agent/serviceaccount.yaml",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    by_hand = [d for d in yaml.safe_load_all(proc.stdout) if d]
    paths = {
        "ServiceAccount": f"/api/v1/namespaces/{ns}/serviceaccounts",
        "ClusterRole": "/apis/rbac.authorization.k8s.io/v1/clusterroles",
        "ClusterRoleBinding": "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
        "Role": f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles",
        "RoleBinding": f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings",
        "ValidatingAdmissionPolicy": "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies",
        "ValidatingAdmissionPolicyBinding": "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicybindings",
    }  # fmt: skip
    for doc in by_hand:
        doc["metadata"]["labels"] = {}  # as the hand-written files had none
        cluster.request("POST", paths[doc["kind"]], body=doc)

    args = ["install", rel, str(CHART), "-n", ns, *IMAGE, "--set", "extender.enabled=false",
            "--set", "scheduler.enabled=false"]  # fmt: skip
    if helm_major(helm) >= 4:
        # Helm 4 applies server-side: the fields set by hand belong to another field
        # manager, and docs/upgrade.md says to take them over with --force-conflicts.
        args.append("--force-conflicts")
    refused = run_helm(helm, *args, kubeconfig=cluster.kubeconfig)
    assert refused.returncode != 0
    assert "invalid ownership metadata" in refused.stderr

    marks = {
        "metadata": {
            "annotations": {"meta.helm.sh/release-name": rel, "meta.helm.sh/release-namespace": ns},
            "labels": {"app.kubernetes.io/managed-by": "Helm"},
        }
    }
    for doc in by_hand:
        cluster.request(
            "PATCH",
            f"{paths[doc['kind']]}/{doc['metadata']['name']}",
            body=marks,
            content_type="application/merge-patch+json",
        )
    adopted = run_helm(helm, *args, kubeconfig=cluster.kubeconfig)
    assert adopted.returncode == 0, adopted.stderr
    gone, _ = uninstall(helm, cluster, rel, ns, tmp_path)
    assert gone.returncode == 0, gone.stderr
    for doc in by_hand:
        assert cluster.get(f"{paths[doc['kind']]}/{doc['metadata']['name']}") is None, doc["kind"]


def test_without_the_pod_resources_mount_every_pod_meets_the_restricted_standard(
    helm: str, cluster: Cluster
) -> None:
    """docs/security.md: the agent's only hostPath is the pod-resources directory. With
    it switched off, the real PodSecurity admission of a namespace enforcing
    `restricted` admits the agent, extender and scheduler pods; with it on, the agent's
    pods are refused there (and need a namespace that allows hostPath)."""
    for rel, extra in (("pss", ["--set", "agent.podResources.enabled=false"]), ("pss-default", [])):
        ns = f"gpudaemon-{rel}"
        cluster.request(
            "POST",
            "/api/v1/namespaces",
            body={
                "metadata": {
                    "name": ns,
                    "labels": {"pod-security.kubernetes.io/enforce": "restricted"},
                }
            },
        )
        proc = run_helm(
            helm, "install", rel, str(CHART), "-n", ns, *IMAGE, *extra,
            kubeconfig=cluster.kubeconfig,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr

    def components(ns: str) -> set[str]:
        pods = cluster.items(f"/api/v1/namespaces/{ns}/pods")
        return {p["metadata"]["labels"]["app.kubernetes.io/component"] for p in pods}

    cluster.wait(
        lambda: components("gpudaemon-pss") == {"agent", "scheduler"},
        "agent and scheduler (with the extender) pods admitted under 'restricted'",
    )
    agents = cluster.items(
        "/api/v1/namespaces/gpudaemon-pss/pods", "app.kubernetes.io/component=agent"
    )
    assert len(agents) == len(GPU_NODES)

    def refused() -> list[str]:
        events = cluster.items("/api/v1/namespaces/gpudaemon-pss-default/events")
        return [
            e["message"]
            for e in events
            if e["reason"] == "FailedCreate" and e["involvedObject"]["kind"] == "DaemonSet"
        ]

    messages = cluster.wait(refused, "the DaemonSet's pods refused under 'restricted'")
    assert 'volume "pod-resources" uses restricted volume type "hostPath"' in messages[0]
    assert components("gpudaemon-pss-default") == {"scheduler"}
