"""Least privilege, against the real API server: deploy/manifests/rbac.yaml lets the
agent patch Nodes and write Leases in its namespace and nothing more, and
deploy/manifests/admission-policy.yaml keeps it to keys under its prefix, off the spec
and the rest of the metadata (owner references, finalizers), off the rebalancer's and
the scheduler's Leases, and (with a pod-bound token) on its own Node and Lease."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from gpudaemon.errors import KubeError, KubeForbiddenError
from gpudaemon.kube.client import NODE_LEASE_LABELS, Credentials, KubeClient
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


def bound_agent(control_plane: ControlPlane, node: str, tmp_path: Path) -> KubeClient:
    """The agent's ServiceAccount with a token bound to a pod on `node`, as kubelet
    mounts it (the API server adds the node's name to it)."""
    pod = control_plane.admin.request(
        "POST",
        "/api/v1/namespaces/gpudaemon/pods",
        body={
            "metadata": {"name": f"agent-{node}"},
            "spec": {
                "nodeName": node,
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
        tmp_path / f"bound-{node}",
        control_plane.server,
        "bound",
        tr["status"]["token"],
        control_plane.ca,
    )
    return KubeClient.from_credentials(Credentials(False, str(kc)))


def test_pod_bound_token_may_change_only_its_own_node(
    control_plane: ControlPlane, tmp_path: Path
) -> None:
    mine, other = (f"bound-{uuid.uuid4().hex[:6]}" for _ in range(2))
    control_plane.create_node(mine)
    control_plane.create_node(other)
    bound = bound_agent(control_plane, mine, tmp_path)
    try:
        patch(bound, mine, {"metadata": {"labels": {"gpudaemon.io/x": "1"}}})
        msg = denied(bound, other, {"metadata": {"labels": {"gpudaemon.io/x": "1"}}})
        assert "only the Node its pod runs on" in msg
    finally:
        bound.close()


CONDITION = {"type": "GPUHealthy", "status": "True", "reason": "AllGPUsHealthy", "message": "ok"}


def test_agent_may_change_no_other_metadata_of_its_node(
    control_plane: ControlPlane, node: str
) -> None:
    """An owner reference to a missing object has the garbage collector delete the
    Node; a finalizer blocks its deletion. Neither, through the Node or its status."""
    agent = control_plane.as_agent()
    gone = {"apiVersion": "v1", "kind": "ConfigMap", "name": "gone", "uid": str(uuid.uuid4())}
    msg = "may change only labels and annotations of a Node's metadata"
    for status in (False, True):
        for meta in (
            {"finalizers": ["example.com/hold"]},
            {"ownerReferences": [gone]},
            {"labels": {"gpudaemon.io/ok": "1"}, "finalizers": ["example.com/hold"]},
        ):
            with pytest.raises(KubeError) as e:
                agent.patch_node(node, {"metadata": meta}, status=status)
            assert e.value.status == 422 and msg in str(e.value), (status, meta, e.value)
    with pytest.raises(KubeError) as e:  # the same through server-side apply
        agent.apply(f"/api/v1/nodes/{node}", {
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": node, "finalizers": ["example.com/hold"]},
        })  # fmt: skip
    assert msg in str(e.value)
    meta = control_plane.node(node)["metadata"]
    assert "finalizers" not in meta and "ownerReferences" not in meta
    # What the agent does write still goes through: server-side apply of its labels
    # and annotations, the GPUHealthy condition on the status; and an admin's
    # finalizer stays untouched by it.
    control_plane.admin.patch_node(node, {"metadata": {"finalizers": ["example.com/admin"]}})
    try:
        agent.apply_node(node, {"gpudaemon.io/gpu.count": "8"}, {"gpudaemon.io/gpus": "[]"})
        agent.patch_node(node, {"status": {"conditions": [CONDITION]}}, status=True)
        after = control_plane.node(node)
        assert after["metadata"]["labels"]["gpudaemon.io/gpu.count"] == "8"
        assert after["metadata"]["finalizers"] == ["example.com/admin"]
        assert any(c["type"] == "GPUHealthy" for c in after["status"]["conditions"])
        assert "may change only labels" in denied(agent, node, {"metadata": {"finalizers": None}})
    finally:
        control_plane.admin.patch_node(node, {"metadata": {"finalizers": None}})
        agent.close()


def lease_denied(client: KubeClient, name: str, **meta: Any) -> str:
    body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": name, "namespace": "gpudaemon", **meta},
            "spec": {"holderIdentity": "x"}}  # fmt: skip
    with pytest.raises(KubeError) as e:
        client.apply(f"/apis/coordination.k8s.io/v1/namespaces/gpudaemon/leases/{name}", body)
    assert e.value.status == 422, e.value
    return str(e.value)


def test_agent_may_not_write_the_rebalancers_or_schedulers_lease_or_dress_up_its_own(
    control_plane: ControlPlane,
) -> None:
    agent = control_plane.as_agent()
    name = f"lease-{uuid.uuid4().hex[:6]}"
    try:
        for other in ("gpudaemon-rebalancer", "gpudaemon-scheduler"):
            assert "may not write the rebalancer's Lease" in lease_denied(agent, other)
            assert control_plane.lease(other) is None
        node = {"apiVersion": "v1", "kind": "Node", "name": name, "uid": str(uuid.uuid4())}
        elsewhere = {**node, "name": "some-other-node"}
        msg = "may set only an owner reference to its Node and its two node-lease labels"
        for meta in (
            {"finalizers": ["example.com/hold"]},
            {"labels": {"gpudaemon.io/x": "1"}},
            {"labels": {**NODE_LEASE_LABELS, "gpudaemon.io/x": "1"}},
            {"annotations": {"gpudaemon.io/rebalancer-state": "{}"}},
            {"ownerReferences": [elsewhere]},
            {"ownerReferences": [{**node, "blockOwnerDeletion": True}]},
            {"ownerReferences": [{**node, "kind": "ConfigMap"}]},
        ):
            assert msg in lease_denied(agent, name, **meta), meta
        assert control_plane.lease(name) is None
        # What the agent writes: its Lease, owned by its Node (deleted with it), with
        # the labels `gpudaemon status` finds it by.
        agent.apply_lease("gpudaemon", name, {"holderIdentity": "me"}, owner=node)
        assert control_plane.lease(name)["metadata"]["labels"] == NODE_LEASE_LABELS  # type: ignore[index]
        assert msg in lease_denied(agent, name, finalizers=["example.com/hold"])
        lease = control_plane.lease(name)
        assert lease is not None and lease["metadata"]["ownerReferences"][0]["name"] == name
    finally:
        agent.close()


def test_pod_bound_token_on_a_node_named_like_the_rebalancers_lease_cannot_write_it(
    control_plane: ControlPlane, tmp_path: Path
) -> None:
    """The rebalancer's Lease will hold the reservations the extender trusts: a Node
    that happens to bear its name gives that node's agent no claim on it."""
    control_plane.create_node("gpudaemon-rebalancer")
    bound = bound_agent(control_plane, "gpudaemon-rebalancer", tmp_path)
    try:
        patch(bound, "gpudaemon-rebalancer", {"metadata": {"labels": {"gpudaemon.io/x": "1"}}})
        msg = lease_denied(bound, "gpudaemon-rebalancer")
        assert "may not write the rebalancer's Lease" in msg
        assert control_plane.lease("gpudaemon-rebalancer") is None
    finally:
        bound.close()
        control_plane.admin.request("DELETE", "/api/v1/nodes/gpudaemon-rebalancer")
