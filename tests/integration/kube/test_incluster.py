"""A pod's agent on the official client (issue 29): the service account's layout
(token, ca.crt, namespace) and $KUBERNETES_SERVICE_HOST/PORT as kubelet provides them,
read by `kubernetes.config`'s in-cluster loader (kube/incluster.py), against the real
kube-apiserver.

The tokens are real bound service-account tokens (TokenRequest, bound to a Secret, as
kubelet's projected tokens are bound to the pod): deleting the Secret revokes one,
which is what makes an old token stop working after kubelet rotates it."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from gpudaemon import incluster
from gpudaemon.errors import ConfigError, KubeForbiddenError, KubeUnavailableError
from gpudaemon.kube.client import Credentials, KubeClient
from tests.integration.kube.controlplane import ControlPlane
from tests.support import (
    free_port,
    http_get,
    service_account_dir,
    start_agent_in_pod,
    stop,
    wait_for,
)

pytestmark = pytest.mark.integration

NS, SA = "gpudaemon", "gpudaemon"  # deploy/manifests/rbac.yaml's ServiceAccount


def bound_token(cp: ControlPlane, secret: str) -> str:
    """A token for the agent's ServiceAccount, valid while `secret` exists."""
    made = cp.admin.request(
        "POST",
        f"/api/v1/namespaces/{NS}/secrets",
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": secret}},
    )
    req = cp.admin.request(
        "POST",
        f"/api/v1/namespaces/{NS}/serviceaccounts/{SA}/token",
        {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "expirationSeconds": 3600,
                "boundObjectRef": {
                    "apiVersion": "v1",
                    "kind": "Secret",
                    "name": secret,
                    "uid": made["metadata"]["uid"],
                },
            },
        },
    )
    return str(req["status"]["token"])


def revoke(cp: ControlPlane, secret: str) -> None:
    cp.admin.request("DELETE", f"/api/v1/namespaces/{NS}/secrets/{secret}")


def status_with(cp: ControlPlane, token: str, node: str) -> int:
    """What the API server answers a GET of the Node with this bearer token."""
    import ssl
    import urllib.error
    import urllib.request

    req = urllib.request.Request(
        f"{cp.server}/api/v1/nodes/{node}", headers={"Authorization": f"Bearer {token}"}
    )
    try:
        with urllib.request.urlopen(
            req, context=ssl.create_default_context(cafile=str(cp.ca)), timeout=10
        ) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


@pytest.fixture
def in_pod(control_plane: ControlPlane, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This process as a pod: the layout in tmp_path, the server in the environment."""
    host, _, port = control_plane.server.removeprefix("https://").rpartition(":")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", host)
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", port)
    sa = service_account_dir(tmp_path / "sa", "agent-token\n", Path(control_plane.ca))
    monkeypatch.setattr(incluster, "SA_DIR", sa)
    return sa


def test_the_agent_s_calls_work_with_the_mounted_token_and_ca(
    control_plane: ControlPlane, in_pod: Path
) -> None:
    cp = control_plane
    node = f"gpu-{uuid.uuid4().hex[:8]}"
    uid = cp.create_node(node)["metadata"]["uid"]
    client = KubeClient.from_credentials(Credentials(in_cluster=True), timeout_s=10)
    try:
        assert type(client.api).__module__ == "kubernetes.client.api_client"  # the official
        assert client.get_node(node)["metadata"]["uid"] == uid
        assert client.get_node(node, cached=True)["metadata"]["uid"] == uid
        client.apply_node(node, {"gpudaemon.io/gpu.count": "8"}, {})
        assert cp.node(node)["metadata"]["labels"]["gpudaemon.io/gpu.count"] == "8"
        items, rv = client.list_items("/api/v1/nodes", {"fieldSelector": f"metadata.name={node}"})
        assert [i["metadata"]["name"] for i in items] == [node] and rv
        client.apply_node(node, {"gpudaemon.io/gpu.count": "7"}, {})
        events = client.watch("/api/v1/nodes", rv, 5, {"fieldSelector": f"metadata.name={node}"})
        kind, obj = next(events)
        assert kind == "MODIFIED" and obj["metadata"]["labels"]["gpudaemon.io/gpu.count"] == "7"
        events.close()
    finally:
        client.close()


def test_a_rotated_token_is_read_again_after_the_period(
    control_plane: ControlPlane, in_pod: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpudaemon.kube import incluster as kube_incluster

    cp = control_plane
    node = f"gpu-{uuid.uuid4().hex[:8]}"
    cp.create_node(node)
    (in_pod / "token").write_text("expired-token")
    client = KubeClient.from_credentials(Credentials(in_cluster=True), timeout_s=10)
    try:
        with pytest.raises(KubeForbiddenError, match="401"):
            client.get_node(node)
        (in_pod / "token").write_text("agent-token")  # kubelet rotated it
        with pytest.raises(KubeForbiddenError, match="401"):
            client.get_node(node)  # within the minute: still the old one
    finally:
        client.close()
    monkeypatch.setattr(kube_incluster, "TOKEN_REREAD_S", 0.0)
    (in_pod / "token").write_text("expired-token")
    client = KubeClient.from_credentials(Credentials(in_cluster=True), timeout_s=10)
    try:
        with pytest.raises(KubeForbiddenError, match="401"):
            client.get_node(node)
        (in_pod / "token").write_text("agent-token")
        assert client.get_node(node)["metadata"]["name"] == node  # the period has passed
    finally:
        client.close()


def test_a_server_the_mounted_ca_does_not_vouch_for_is_refused(
    control_plane: ControlPlane, in_pod: Path, tmp_path: Path
) -> None:
    from tests.certs import make_pki

    (tmp_path / "pki").mkdir()
    other = make_pki(tmp_path / "pki")
    (in_pod / "ca.crt").write_bytes(Path(other.ca).read_bytes())
    client = KubeClient.from_credentials(Credentials(in_cluster=True), timeout_s=5)
    try:
        with pytest.raises(KubeUnavailableError, match=r"CERTIFICATE_VERIFY_FAILED|certificate"):
            client.get_node("any")
    finally:
        client.close()


def test_a_missing_token_or_ca_is_one_configuration_error(in_pod: Path) -> None:
    (in_pod / "token").rename(in_pod / "token.away")
    with pytest.raises(ConfigError, match="token file does not exist"):
        KubeClient.from_credentials(Credentials(in_cluster=True))
    (in_pod / "token.away").rename(in_pod / "token")
    (in_pod / "ca.crt").unlink()
    with pytest.raises(ConfigError, match="certification file does not exist"):
        KubeClient.from_credentials(Credentials(in_cluster=True))


# -- the whole agent as a pod runs it ----------------------------------------------------


def renewed(cp: ControlPlane, node: str) -> str:
    return str(((cp.lease(node) or {}).get("spec") or {}).get("renewTime") or "")


def test_a_pod_s_agent_runs_the_official_client_through_a_token_rotation(
    control_plane: ControlPlane, tmp_path: Path
) -> None:
    """`gpudaemon run` with no kubeconfig and nothing about Kubernetes in its
    configuration: it finds the service account, labels its Node and renews its Lease;
    then kubelet rotates the token (a new file, the old token revoked) mid-run, and the
    agent goes on with the new one."""
    cp = control_plane
    tag = uuid.uuid4().hex[:8]
    node = f"gpu-pod-{tag}"
    cp.create_node(node)
    first = bound_token(cp, f"token-a-{tag}")
    second = bound_token(cp, f"token-b-{tag}")
    sa = service_account_dir(tmp_path / "sa", first, Path(cp.ca))
    port = free_port()
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(
        f"node_name: {node}\nsimulate: dgx-h100\n"
        f"metrics: {{listen: '127.0.0.1:{port}'}}\n"
        "labels: {to: apiserver}\n"
        "kubernetes: {lease_duration_seconds: 10}\n"  # renewed every few seconds
    )
    log = tmp_path / "agent.log"
    proc = start_agent_in_pod(
        ["run", "--config", str(cfg)], sa, cp.server, log=log, token_reread_s=1.0
    )
    try:
        wait_for(
            lambda: (
                cp.node(node)["metadata"].get("labels", {}).get("gpudaemon.io/gpu.count") == "8"
            ),
            60,
            what="the Node labelled by the pod's agent",
        )
        wait_for(lambda: renewed(cp, node), 30, what="the agent's Lease")
        # kubelet rotates: the new token replaces the file at once (it swaps a symlink),
        # and the old one stops working.
        tmp = sa / "token.new"
        tmp.write_text(second)
        os.replace(tmp, sa / "token")
        revoke(cp, f"token-a-{tag}")
        wait_for(lambda: status_with(cp, first, node) == 401, 30, what="the old token revoked")
        assert status_with(cp, second, node) == 200
        # Renewals after the revocation can only have used the new token.
        since = renewed(cp, node)
        wait_for(lambda: renewed(cp, node) != since, 30, what="a renewal with the new token")
        since = renewed(cp, node)
        wait_for(lambda: renewed(cp, node) != since, 30, what="another renewal")
        # And a label the agent owns, removed by hand, is written back with it.
        cp.admin.request(
            "PATCH",
            f"/api/v1/nodes/{node}",
            {"metadata": {"labels": {"gpudaemon.io/gpu.count": None}}},
            "application/merge-patch+json",
        )
        wait_for(
            lambda: (
                cp.node(node)["metadata"].get("labels", {}).get("gpudaemon.io/gpu.count") == "8"
            ),
            60,
            what="the label written back after the rotation",
        )
        assert http_get(f"http://127.0.0.1:{port}/readyz")[0] == 200
    except AssertionError as e:
        raise AssertionError(f"{e}\n--- the agent's log ---\n{log.read_text()[-4000:]}") from None
    finally:
        stop(proc)
    assert proc.returncode == 0, log.read_text()[-3000:]
