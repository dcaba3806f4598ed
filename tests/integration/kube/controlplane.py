"""A real etcd + kube-apiserver on 127.0.0.1, for the kube tests and bench/apiwrites.

Two identities, by static token: `admin` (system:masters) for the test's own setup and
assertions, and the agent's ServiceAccount user, which has only what
deploy/manifests/rbac.yaml grants (the tests apply exactly that file).
"""

from __future__ import annotations

import json
import re
import shutil
import ssl
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from gpudaemon.errors import KubeError, KubeNotFoundError
from gpudaemon.kube.client import Credentials, KubeClient
from tests.support import REPO, ProcessExited, free_port, wait_for

AGENT_USER = "system:serviceaccount:gpudaemon:gpudaemon"
RBAC = REPO / "deploy" / "manifests" / "rbac.yaml"
ADMISSION = REPO / "deploy" / "manifests" / "admission-policy.yaml"

# kind -> (API prefix, plural, namespaced), for the kinds our manifests use.
_KINDS: dict[str, tuple[str, str, bool]] = {
    "Namespace": ("/api/v1", "namespaces", False),
    "ServiceAccount": ("/api/v1", "serviceaccounts", True),
    "ClusterRole": ("/apis/rbac.authorization.k8s.io/v1", "clusterroles", False),
    "ClusterRoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "clusterrolebindings", False),
    "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles", True),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings", True),
    "ValidatingAdmissionPolicy": (
        "/apis/admissionregistration.k8s.io/v1",
        "validatingadmissionpolicies",
        False,
    ),
    "ValidatingAdmissionPolicyBinding": (
        "/apis/admissionregistration.k8s.io/v1",
        "validatingadmissionpolicybindings",
        False,
    ),
}


def _kubeconfig(path: Path, server: str, user: str, token: str, ca: Path) -> Path:
    """TLS verified against the CA kube-apiserver generates in --cert-dir."""
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {"name": "t", "cluster": {"server": server, "certificate-authority": str(ca)}}
                ],
                "users": [{"name": user, "user": {"token": token}}],
                "contexts": [{"name": "t", "context": {"cluster": "t", "user": user}}],
                "current-context": "t",
            }
        )
    )
    return path


class ControlPlane:
    def __init__(self, bin_dir: Path, workdir: Path | None = None) -> None:
        self.bin = bin_dir
        self.dir = workdir or Path(tempfile.mkdtemp(prefix="gpudaemon-kube-"))
        self._own_dir = workdir is None
        self.etcd_port, self.peer_port, self.port = free_port(), free_port(), free_port()
        self.server = f"https://127.0.0.1:{self.port}"
        # kube-apiserver writes its self-signed serving cert and CA here at first start.
        self.ca = self.dir / "certs" / "apiserver.crt"
        self.etcd: subprocess.Popen[bytes] | None = None
        self.apiserver: subprocess.Popen[bytes] | None = None
        self.admin_kubeconfig = _kubeconfig(
            self.dir / "admin.kubeconfig", self.server, "admin", "admin-token", self.ca
        )
        self.agent_kubeconfig = _kubeconfig(
            self.dir / "agent.kubeconfig", self.server, "agent", "agent-token", self.ca
        )
        self._admin: KubeClient | None = None

    # -- processes ---------------------------------------------------------------

    def start(self) -> ControlPlane:
        d = self.dir
        (d / "tokens.csv").write_text(
            'admin-token,admin,admin-uid,"system:masters"\n'
            f"agent-token,{AGENT_USER},agent-uid,"
            '"system:serviceaccounts,system:serviceaccounts:gpudaemon"\n'
        )
        subprocess.run(
            ["openssl", "genrsa", "-out", str(d / "sa.key"), "2048"],
            check=True,
            capture_output=True,
        )
        subprocess.run(
            ["openssl", "rsa", "-in", str(d / "sa.key"), "-pubout", "-out", str(d / "sa.pub")],
            check=True,
            capture_output=True,
        )
        peer = f"http://127.0.0.1:{self.peer_port}"
        client = f"http://127.0.0.1:{self.etcd_port}"
        with open(d / "etcd.log", "wb") as log:  # the child keeps its own copy
            self.etcd = subprocess.Popen(
                [
                    str(self.bin / "etcd"),
                    "--data-dir",
                    str(d / "etcd"),
                    "--listen-client-urls",
                    client,
                    "--advertise-client-urls",
                    client,
                    "--listen-peer-urls",
                    peer,
                    "--initial-advertise-peer-urls",
                    peer,
                    "--initial-cluster",
                    f"default={peer}",
                    "--unsafe-no-fsync",
                    "--log-level",
                    "warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.start_apiserver()
        return self

    def start_apiserver(self) -> None:
        d = self.dir
        with open(d / "apiserver.log", "ab") as log:
            self.apiserver = subprocess.Popen(
                [
                    str(self.bin / "kube-apiserver"),
                    f"--etcd-servers=http://127.0.0.1:{self.etcd_port}",
                    f"--cert-dir={d / 'certs'}",
                    f"--secure-port={self.port}",
                    "--bind-address=127.0.0.1",
                    "--advertise-address=127.0.0.1",
                    # Since 1.37 the endpoint reconciler (the `kubernetes` Service's
                    # endpoints) refuses a loopback address; nothing here uses them.
                    "--endpoint-reconciler-type=none",
                    "--service-cluster-ip-range=10.0.0.0/24",
                    "--authorization-mode=RBAC",
                    f"--token-auth-file={d / 'tokens.csv'}",
                    f"--service-account-issuer=https://127.0.0.1:{self.port}/",
                    f"--service-account-key-file={d / 'sa.pub'}",
                    f"--service-account-signing-key-file={d / 'sa.key'}",
                    "--disable-admission-plugins=ServiceAccount",
                    "--v=0",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        wait_for(self._ready, timeout=120, interval=0.5, what="kube-apiserver /readyz")

    def _ready(self) -> bool:
        if self.apiserver is not None and self.apiserver.poll() is not None:
            tail = (self.dir / "apiserver.log").read_text()[-2000:]
            raise ProcessExited(f"kube-apiserver exited {self.apiserver.returncode}:\n{tail}")
        req = urllib.request.Request(
            f"{self.server}/readyz", headers={"Authorization": "Bearer admin-token"}
        )
        ctx = ssl._create_unverified_context()  # the CA file may not exist yet
        with urllib.request.urlopen(req, context=ctx, timeout=5) as r:
            return bool(r.status == 200)

    def requests(self, resource: str, verbs: tuple[str, ...]) -> float:
        """kube-apiserver's own count of requests (`apiserver_request_total`) for one
        resource and some verbs (GET, LIST, WATCH, PATCH, APPLY, UPDATE...), summed over
        codes: what the server really served, whoever asked."""
        req = urllib.request.Request(
            f"{self.server}/metrics", headers={"Authorization": "Bearer admin-token"}
        )
        ctx = ssl.create_default_context(cafile=str(self.ca))
        with urllib.request.urlopen(req, context=ctx, timeout=30) as r:
            text = r.read().decode()
        total = 0.0
        for line in text.splitlines():
            if not line.startswith("apiserver_request_total{"):
                continue
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
            if labels.get("resource") == resource and labels.get("verb") in verbs:
                total += float(line.rsplit(" ", 1)[1])
        return total

    def stop_apiserver(self) -> None:
        if self.apiserver is not None and self.apiserver.poll() is None:
            self.apiserver.terminate()
            try:
                self.apiserver.wait(30)
            except subprocess.TimeoutExpired:
                self.apiserver.kill()
                self.apiserver.wait()
        self.apiserver = None

    def stop(self) -> None:
        self.stop_apiserver()
        if self.etcd is not None and self.etcd.poll() is None:
            self.etcd.terminate()
            try:
                self.etcd.wait(15)
            except subprocess.TimeoutExpired:
                self.etcd.kill()
                self.etcd.wait()
        if self._admin is not None:
            self._admin.close()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    # -- admin helpers -----------------------------------------------------------

    @property
    def admin(self) -> KubeClient:
        if self._admin is None:
            self._admin = KubeClient.from_credentials(
                Credentials(False, str(self.admin_kubeconfig)), timeout_s=30
            )
        return self._admin

    def apply_manifest(self, path: Path) -> None:
        """Server-side apply every document, as admin (like `kubectl apply --server-side`)."""
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc:
                continue
            prefix, plural, namespaced = _KINDS[doc["kind"]]
            meta = doc["metadata"]
            ns = f"/namespaces/{meta['namespace']}" if namespaced else ""
            self.admin.request(
                "PATCH",
                f"{prefix}{ns}/{plural}/{meta['name']}",
                doc,
                "application/apply-patch+yaml",
                {"fieldManager": "tests", "force": "true"},
            )

    def wait_for_policy(self) -> None:
        """Policies take effect asynchronously: probe until the agent is refused a
        foreign label on a scratch Node."""
        name = f"policy-probe-{self.port}"
        self.create_node(name, {"team": "x"})
        agent = self.as_agent()

        def refused() -> bool:
            try:
                agent.request(
                    "PATCH",
                    f"/api/v1/nodes/{name}",
                    body={"metadata": {"labels": {"team": "y"}}},
                    content_type="application/merge-patch+json",
                )
            except KubeError as e:
                return "gpudaemon.io/" in str(e)
            self.admin.request(
                "PATCH",
                f"/api/v1/nodes/{name}",
                body={"metadata": {"labels": {"team": "x"}}},
                content_type="application/merge-patch+json",
            )
            return False

        wait_for(refused, timeout=30, interval=0.5, what="admission policy in force")
        agent.close()
        self.admin.request("DELETE", f"/api/v1/nodes/{name}")

    def create_node(self, name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
        body = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": name, "labels": labels or {}},
            "status": {"capacity": {"nvidia.com/gpu": "8"}, "allocatable": {"nvidia.com/gpu": "8"}},
        }
        return self.admin.request("POST", "/api/v1/nodes", body=body)

    def node(self, name: str) -> dict[str, Any]:
        return self.admin.get_node(name)

    def lease(self, name: str, namespace: str = "gpudaemon") -> dict[str, Any] | None:
        try:
            return self.admin.request(
                "GET", f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{name}"
            )
        except KubeNotFoundError:
            return None

    def as_agent(self) -> KubeClient:
        return KubeClient.from_credentials(Credentials(False, str(self.agent_kubeconfig)))


def annotation(node: dict[str, Any], key: str = "gpudaemon.io/gpus") -> Any:
    return json.loads(node["metadata"]["annotations"][key])


def wait_deadline(seconds: float) -> float:
    return time.monotonic() + seconds
