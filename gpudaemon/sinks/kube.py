"""The only module that imports the kubernetes client (Node labels/annotations, Lease)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

SA_TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")


@dataclass(frozen=True)
class Credentials:
    in_cluster: bool
    kubeconfig: str = ""


def find_credentials(kubeconfig: str = "") -> Credentials | None:
    """In-cluster service account first, then the kubeconfig; None if neither exists."""
    if kubeconfig:
        return Credentials(in_cluster=False, kubeconfig=kubeconfig)
    if os.environ.get("KUBERNETES_SERVICE_HOST") and SA_TOKEN.is_file():
        return Credentials(in_cluster=True)
    for candidate in filter(
        None,
        [
            *os.environ.get("KUBECONFIG", "").split(os.pathsep),
            str(Path.home() / ".kube" / "config"),
        ],
    ):
        if Path(candidate).is_file():
            return Credentials(in_cluster=False, kubeconfig=candidate)
    return None
