"""helm and a kubelet-less cluster (etcd, kube-apiserver, kube-controller-manager,
kube-scheduler) with four GPU Nodes and two CPU-only Nodes, shared by the chart tests."""

from __future__ import annotations

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


@pytest.fixture(scope="session")
def helm(tools_bin: Path) -> str:
    path = tools_bin / "helm"
    assert path.is_file(), f"{path} missing: scripts/test-tools helm builds it"
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
def cluster(tools_bin: Path) -> Iterator[Cluster]:
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


def run_helm(
    helm: str, *args: str, kubeconfig: Path | None = None
) -> subprocess.CompletedProcess[str]:
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
    """`helm install gpudaemon` with default values into namespace gpudaemon, once its
    agent pods are bound to the GPU nodes. Returns the namespace."""
    ns = "gpudaemon"
    proc = run_helm(
        helm, "install", "gpudaemon", str(CHART), "--namespace", ns, "--create-namespace",
        kubeconfig=cluster.kubeconfig,
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
