"""The chart's read-only RBAC for people who run `gpudaemon status`: it grants only the
reads `status` makes (Nodes and pods, the agents' Leases in the release namespace), binds
nobody unless `statusReader.subjects` names someone, and is enough: a user bound to it
as docs/operations.md shows runs `status` against the installed release, with and
without `-n`, and may not read Secrets."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from gpudaemon.errors import KubeForbiddenError
from gpudaemon.kube.client import Credentials, KubeClient
from tests.integration.helm.cluster import Cluster
from tests.integration.helm.conftest import GPU_NODES
from tests.integration.helm.test_chart import one, template
from tests.integration.kube.controlplane import _kubeconfig
from tests.support import run_cli

pytestmark = pytest.mark.integration

NAME = "gpudaemon-status-reader"
RBAC = "rbac.authorization.k8s.io"


def test_the_status_reader_grants_only_what_status_reads(helm: str) -> None:
    docs = template(helm)
    assert one(docs, "ClusterRole", NAME)["rules"] == [
        {"apiGroups": [""], "resources": ["nodes", "pods"], "verbs": ["get", "list"]}
    ]
    role = one(docs, "Role", NAME)
    assert role["metadata"]["namespace"] == "gpudaemon"
    assert role["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "list"]}
    ]
    assert not any(
        "rbac.authorization.k8s.io/aggregate-to-view" in (d["metadata"].get("labels") or {})
        for d in docs
    )
    assert not [d for d in docs if d["kind"].endswith("Binding") and NAME in d["metadata"]["name"]]


def test_subjects_are_bound_and_enabled_false_renders_nothing(helm: str) -> None:
    docs = template(
        helm,
        "--set", "statusReader.subjects[0].kind=Group",
        "--set", "statusReader.subjects[0].name=gpu-operators",
        "--set", f"statusReader.subjects[0].apiGroup={RBAC}",
    )  # fmt: skip
    subject = [{"kind": "Group", "name": "gpu-operators", "apiGroup": RBAC}]
    assert one(docs, "ClusterRoleBinding", NAME)["subjects"] == subject
    assert one(docs, "ClusterRoleBinding", NAME)["roleRef"]["name"] == NAME
    binding = one(docs, "RoleBinding", NAME)
    assert binding["subjects"] == subject
    assert binding["roleRef"] == {"apiGroup": RBAC, "kind": "Role", "name": NAME}
    off = template(helm, "--set", "statusReader.enabled=false")
    assert not [d for d in off if NAME in d["metadata"]["name"]]


def test_a_user_bound_to_the_status_reader_runs_status(
    cluster: Cluster, release: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ns, user = release, f"status-user-{uuid.uuid4().hex[:6]}"
    cluster.request("POST", f"/api/v1/namespaces/{ns}/serviceaccounts",
                    body={"metadata": {"name": user}})  # fmt: skip
    subjects = [{"kind": "ServiceAccount", "name": user, "namespace": ns}]
    cluster.request("POST", f"/apis/{RBAC}/v1/clusterrolebindings", body={
        "metadata": {"name": user}, "subjects": subjects,
        "roleRef": {"apiGroup": RBAC, "kind": "ClusterRole", "name": NAME}})  # fmt: skip
    cluster.request("POST", f"/apis/{RBAC}/v1/namespaces/{ns}/rolebindings", body={
        "metadata": {"name": user}, "subjects": subjects,
        "roleRef": {"apiGroup": RBAC, "kind": "Role", "name": NAME}})  # fmt: skip
    try:
        token = cluster.request(
            "POST", f"/api/v1/namespaces/{ns}/serviceaccounts/{user}/token",
            body={"spec": {"expirationSeconds": 3600}},
        )["status"]["token"]  # fmt: skip
        kc = _kubeconfig(tmp_path / "kubeconfig", cluster.cp.server, user, token, cluster.cp.ca)
        for k in ("KUBECONFIG", "GPUDAEMON_KUBERNETES__LEASE_NAMESPACE"):
            monkeypatch.delenv(k, raising=False)

        def status(*args: str) -> dict[str, dict[str, object]]:
            # RBAC changes reach the authorizer's cache within a moment.
            def ok() -> str | None:
                r = run_cli("status", "--kubeconfig", str(kc), "-o", "json", *args)
                return r.stdout if r.returncode == 0 else None

            out = cluster.wait(ok, f"status {' '.join(args)} as the bound user", timeout=30)
            return {n["name"]: n for n in json.loads(out)["nodes"]}

        # Without -n the Lease list across namespaces is refused, and the release
        # namespace (kubernetes.lease_namespace's default) is read. No kubelet runs the
        # agents here: each node is fresh (an agent of an earlier test renewed its Lease)
        # or says why not in an operator's words (no Lease there, a released or expired
        # one, no agent labels), never that a read was forbidden.
        for args in (("-n", ns), ()):
            nodes = status(*args)
            assert sorted(nodes) == GPU_NODES
            for n in nodes.values():
                why = n["stale_reason"]
                assert why is None or "forbidden" not in why.lower(), why
        client = KubeClient.from_credentials(Credentials(in_cluster=False, kubeconfig=str(kc)))
        with pytest.raises(KubeForbiddenError):
            client.list_items(f"/api/v1/namespaces/{ns}/secrets")
    finally:
        cluster.request("DELETE", f"/apis/{RBAC}/v1/clusterrolebindings/{user}")
        cluster.request("DELETE", f"/apis/{RBAC}/v1/namespaces/{ns}/rolebindings/{user}")
        cluster.request("DELETE", f"/api/v1/namespaces/{ns}/serviceaccounts/{user}")
