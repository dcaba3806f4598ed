"""Least privilege, against the real API server: deploy/manifests/rbac.yaml lets the
agent patch Nodes and write Leases in its namespace and nothing more, and
deploy/manifests/admission-policy.yaml keeps it to keys under its prefix, off the spec,
and (with a pod-bound token) on its own Node."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from gpudaemon.errors import KubeError, KubeForbiddenError
from gpudaemon.kube.client import Credentials, KubeClient
from tests.integration.kube.controlplane import ControlPlane, _kubeconfig

pytestmark = pytest.mark.integration

MERGE = "application/merge-patch+json"


def patch(client: KubeClient, node: str, body: dict[str, Any]) -> dict[str, Any]:
    return client.request("PATCH", f"/api/v1/nodes/{node}", body=body, content_type=MERGE)


def denied(client: KubeClient, node: str, body: dict[str, Any]) -> str:
    with pytest.raises(KubeError) as e:
        patch(client, node, body)
    assert e.value.status in (403, 422), e.value
    return str(e.value)


def test_agent_may_change_only_its_prefixed_keys(control_plane: ControlPlane, node: str) -> None:
    agent = control_plane.as_agent()
    patch(agent, node, {"metadata": {"labels": {"gpudaemon.io/test": "yes"}}})
    msg = denied(agent, node, {"metadata": {"labels": {"team": "hacked"}}})
    assert "only labels under gpudaemon.io/" in msg
    assert "only labels" in denied(agent, node, {"metadata": {"labels": {"team": None}}})
    assert "only annotations" in denied(
        agent, node, {"metadata": {"annotations": {"example.com/x": "1"}}}
    )
    assert "spec" in denied(agent, node, {"spec": {"unschedulable": True}})
    labels = control_plane.node(node)["metadata"]["labels"]
    assert labels["team"] == "ml" and labels["gpudaemon.io/test"] == "yes"
    # The same changes are fine for anyone else (the policy matches only the agent).
    patch(control_plane.admin, node, {"metadata": {"labels": {"team": "infra"}}})


def test_agent_cannot_create_or_delete_nodes_or_touch_other_namespaces(
    control_plane: ControlPlane,
) -> None:
    agent = control_plane.as_agent()
    name = f"nope-{uuid.uuid4().hex[:6]}"
    with pytest.raises(KubeForbiddenError):
        agent.request("POST", "/api/v1/nodes", body={"metadata": {"name": name}})
    control_plane.create_node(name)
    with pytest.raises(KubeForbiddenError):
        agent.request("DELETE", f"/api/v1/nodes/{name}")
    with pytest.raises(KubeForbiddenError):
        agent.apply_lease("default", name, {"holderIdentity": "x"})
    with pytest.raises(KubeForbiddenError):
        agent.request("GET", "/api/v1/namespaces/gpudaemon/secrets")
    agent.apply_lease("gpudaemon", name, {"holderIdentity": "x"})  # its own namespace


def test_pod_bound_token_may_change_only_its_own_node(
    control_plane: ControlPlane, tmp_path: Path
) -> None:
    mine, other = (f"bound-{uuid.uuid4().hex[:6]}" for _ in range(2))
    control_plane.create_node(mine)
    control_plane.create_node(other)
    pod = control_plane.admin.request(
        "POST",
        "/api/v1/namespaces/gpudaemon/pods",
        body={
            "metadata": {"name": f"agent-{mine}"},
            "spec": {
                "nodeName": mine,
                "serviceAccountName": "gpudaemon",
                "containers": [{"name": "agent", "image": "gpudaemon:test"}],
            },
        },
    )
    tr = control_plane.admin.request(
        "POST",
        "/api/v1/namespaces/gpudaemon/serviceaccounts/gpudaemon/token",
        body={
            "spec": {
                "audiences": [],
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
    kc = _kubeconfig(
        tmp_path / "bound", control_plane.server, "bound", tr["status"]["token"], control_plane.ca
    )
    bound = KubeClient.from_credentials(Credentials(False, str(kc)))
    try:
        patch(bound, mine, {"metadata": {"labels": {"gpudaemon.io/x": "1"}}})
        msg = denied(bound, other, {"metadata": {"labels": {"gpudaemon.io/x": "1"}}})
        assert "only the Node its pod runs on" in msg
    finally:
        bound.close()
