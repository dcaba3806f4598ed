"""The in-cluster client (kube/client.py InClusterApi, issue 19: no kubernetes import in
a pod) against the real kube-apiserver: the service account's token and CA as a pod has
them mounted, reads, server-side applies and a watch; a rotated token is picked up
within the re-read period; a server the CA does not vouch for is refused; a missing
token is one configuration error."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from gpudaemon.errors import ConfigError, KubeForbiddenError, KubeUnavailableError
from gpudaemon.kube.client import InClusterApi, KubeClient
from tests.integration.kube.controlplane import ControlPlane

pytestmark = pytest.mark.integration


def mounted(tmp_path: Path, cp: ControlPlane, token: str) -> InClusterApi:
    (tmp_path / "token").write_text(token + "\n")
    return InClusterApi(cp.server, tmp_path / "token", Path(cp.ca))


def test_the_agent_s_calls_work_with_the_mounted_token_and_ca(
    control_plane: ControlPlane, tmp_path: Path
) -> None:
    cp = control_plane
    node = f"gpu-{uuid.uuid4().hex[:8]}"
    uid = cp.create_node(node)["metadata"]["uid"]
    client = KubeClient(mounted(tmp_path, cp, "agent-token"), timeout_s=10)
    try:
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


def test_a_rotated_token_is_read_again(control_plane: ControlPlane, tmp_path: Path) -> None:
    cp = control_plane
    node = f"gpu-{uuid.uuid4().hex[:8]}"
    cp.create_node(node)
    api = mounted(tmp_path, cp, "expired-token")
    client = KubeClient(api, timeout_s=10)
    try:
        with pytest.raises(KubeForbiddenError, match="401"):
            client.get_node(node)
        (tmp_path / "token").write_text("agent-token\n")  # kubelet rotated it
        with pytest.raises(KubeForbiddenError, match="401"):
            client.get_node(node)  # within the re-read period: still the old one
        api.TOKEN_REREAD_S = 0.0  # the period has passed
        assert client.get_node(node)["metadata"]["name"] == node
    finally:
        client.close()


def test_a_server_the_mounted_ca_does_not_vouch_for_is_refused(
    control_plane: ControlPlane, tmp_path: Path
) -> None:
    from tests.certs import make_pki

    (tmp_path / "pki").mkdir()
    other = make_pki(tmp_path / "pki")
    (tmp_path / "token").write_text("agent-token\n")
    client = KubeClient(
        InClusterApi(control_plane.server, tmp_path / "token", Path(other.ca)), timeout_s=5
    )
    try:
        with pytest.raises(KubeUnavailableError, match=r"CERTIFICATE_VERIFY_FAILED|certificate"):
            client.get_node("any")
    finally:
        client.close()


def test_a_missing_token_or_ca_is_one_configuration_error(
    control_plane: ControlPlane, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match="in-cluster token"):
        InClusterApi(control_plane.server, tmp_path / "absent", Path(control_plane.ca))
    (tmp_path / "token").write_text("agent-token\n")
    with pytest.raises(ConfigError, match="no CA certificate"):
        InClusterApi(control_plane.server, tmp_path / "token", tmp_path / "absent.crt")
