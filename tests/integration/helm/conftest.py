"""helm and a kubelet-less cluster (etcd, kube-apiserver, kube-controller-manager,
kube-scheduler) with four GPU Nodes and two CPU-only Nodes, shared by the chart tests.

Every test that runs helm runs once with Helm 4 (`helm`) and once with Helm 3 (`helm3`,
which many teams keep), each against its own cluster: the tests reuse release names and
namespaces, and the two majors must each prove install, upgrade, refusal and uninstall
from a clean start."""

from __future__ import annotations

import functools
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.helm.cluster import Cluster
from tests.support import REPO

CHART = REPO / "deploy" / "helm" / "gpudaemon"
EVERYTHING = Path(__file__).parent / "values-everything.yaml"
GPU_NODES = [f"gpu-{i}" for i in range(4)]
CPU_NODES = [f"cpu-{i}" for i in range(2)]
# The Prometheus Operator's own CRDs, from its Go module (the module proxy is the one
# place they can come from here), so ServiceMonitor/PrometheusRule get real validation.
PROM_OPERATOR = "github.com/prometheus-operator/prometheus-operator@v0.85.0"


# No gpudaemon image is published yet: the chart refuses to render without one
# (test_image_required.py), so every install and render here names one, as a user must.
IMAGE = ("--set", "image.repository=registry.example.com/gpudaemon")

# The binaries scripts/test-tools installs, and their Helm major.
HELMS = {"helm": 4, "helm3": 3}


@pytest.fixture(scope="session", params=list(HELMS))
def helm(request: pytest.FixtureRequest, tools_bin: Path) -> str:
    path = tools_bin / request.param
    assert path.is_file(), f"{path} missing: scripts/test-tools {request.param} builds it"
    # An older tools directory has Helm 3 as `helm`: then Helm 4 would go untested.
    assert helm_major(str(path)) == HELMS[request.param], (
        f"{path} is not Helm {HELMS[request.param]}"
    )
    return str(path)


def prometheus_operator_crds() -> list[dict[str, object]]:
    proc = subprocess.run(
        ["go", "mod", "download", "-json", PROM_OPERATOR],
        capture_output=True,
        text=True,
        env={**os.environ, "GOTOOLCHAIN": "local", "GOFLAGS": "-mod=mod"},
        cwd="/",
    )
    info = json.loads(proc.stdout or "{}")
    if proc.returncode != 0 or "Dir" not in info:
        pytest.fail(f"go mod download {PROM_OPERATOR}: {info.get('Error') or proc.stderr}")
    crd_dir = Path(info["Dir"]) / "example" / "prometheus-operator-crd"
    return [
        yaml.safe_load((crd_dir / f"monitoring.coreos.com_{k}.yaml").read_text())
        for k in ("servicemonitors", "podmonitors", "prometheusrules")
    ]


@pytest.fixture(scope="session")
def cluster(helm: str, tools_bin: Path) -> Iterator[Cluster]:
    """One per helm binary (`helm` is asked for only for that): a fresh cluster for each."""
    c = Cluster(tools_bin)
    try:
        c.start()
        for name in GPU_NODES:
            c.add_node(name, gpus=8)
        for name in CPU_NODES:
            c.add_node(name, gpus=0)
        for crd in prometheus_operator_crds():
            c.request("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", body=crd)
        c.wait(
            lambda: (
                {"servicemonitors", "podmonitors", "prometheusrules"}
                <= {
                    r["name"]
                    for r in c.request("GET", "/apis/monitoring.coreos.com/v1")["resources"]
                }
            ),
            "the Prometheus Operator CRDs served",
        )
        yield c
    finally:
        c.stop()


@functools.cache
def kube_version(bin_dir: Path) -> str:
    """The version of the kube-apiserver beside helm, e.g. `v1.37.2`."""
    out = subprocess.run(
        [str(bin_dir / "kube-apiserver"), "--version"], capture_output=True, text=True, check=True
    ).stdout
    return out.split()[-1]


@functools.cache
def helm_major(helm: str) -> int:
    """3 or 4, from `helm version --short` (e.g. `v4.3.1+g...`)."""
    out = subprocess.run([helm, "version", "--short"], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().lstrip("v").split(".")[0])


def run_helm(
    helm: str, *args: str, kubeconfig: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Helm 3.19 assumes Kubernetes 1.34 when it asks no cluster (`helm template`,
    `helm lint`), which the chart's kubeVersion refuses: its users pass --kube-version
    (docs/install.md), and so do we, with the version of the servers under test."""
    if Path(helm).name == "helm3" and args[:1] in (("template",), ("lint",)):
        args = (*args, "--kube-version", kube_version(Path(helm).parent))
    env = {**os.environ, "HELM_CACHE_HOME": "/tmp/gpudaemon-helm/cache",
           "HELM_CONFIG_HOME": "/tmp/gpudaemon-helm/config",
           "HELM_DATA_HOME": "/tmp/gpudaemon-helm/data"}  # fmt: skip
    if kubeconfig:
        env["KUBECONFIG"] = str(kubeconfig)
    return subprocess.run([helm, *args], capture_output=True, text=True, env=env, timeout=300)


def agent_pods(cluster: Cluster, namespace: str, instance: str) -> list[dict[str, Any]]:
    return cluster.items(
        f"/api/v1/namespaces/{namespace}/pods",
        f"app.kubernetes.io/instance={instance},app.kubernetes.io/component=agent",
    )


@pytest.fixture(scope="session")
def release(helm: str, cluster: Cluster) -> str:
    """`helm install gpudaemon` with default values (and the one value without a
    default, the image) into namespace gpudaemon, once its agent pods are bound to the
    GPU nodes. Returns the namespace."""
    ns = "gpudaemon"
    proc = run_helm(
        helm, "install", "gpudaemon", str(CHART), "--namespace", ns, "--create-namespace",
        *IMAGE, kubeconfig=cluster.kubeconfig,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cluster.wait(
        lambda: (
            sorted(str(p["spec"].get("nodeName")) for p in agent_pods(cluster, ns, "gpudaemon"))
            == GPU_NODES
        ),
        "one agent pod bound to each GPU node",
    )
    return ns
