"""Where Kubernetes mounts a pod's ServiceAccount credentials. Below both `config.py`
(which decides whether the agent runs in a cluster) and `kube/` (which reads them), so
configuration never imports the Kubernetes layer."""

from __future__ import annotations

from pathlib import Path

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
SA_TOKEN = SA_DIR / "token"
