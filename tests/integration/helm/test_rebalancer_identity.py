"""The chart's rebalancer, really used with only what the chart gives it (issue 22): the
release upgraded with `rebalancer.enabled` and `apply`, the rebalancer run as a real
process with its ConfigMap and a token of its own ServiceAccount bound to the pod the
chart's Deployment created, and `POD_NAME` from that pod as the downward API gives it.
It takes its Lease and lists what it watches; then each write it makes in apply mode
(an Event, the reservation patch, a dryRun eviction) is made with that token on a pod
in another namespace, and a Secret read is refused. Nothing is forbidden along the way.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpudaemon.errors import KubeError
from gpudaemon.kube.client import Credentials, KubeClient
from tests.integration.helm.cluster import Cluster
from tests.integration.helm.conftest import CHART, run_helm
from tests.integration.helm.test_chart_identities import (
    chart_config,
    clean_env,
    component_pod,
    kubeconfig_for,
)
from tests.support import REPO, free_port, http_get, scrape, stop, wait_for

pytestmark = pytest.mark.integration

LEASE = "/apis/coordination.k8s.io/v1/namespaces/{ns}/leases/gpudaemon-rebalancer"


@pytest.fixture
def rebalancer_release(helm: str, cluster: Cluster, release: str) -> Iterator[str]:
    """The session's release with the rebalancer on (apply), and off again afterwards."""

    def upgrade(*values: str) -> None:
        proc = run_helm(helm, "upgrade", "gpudaemon", str(CHART), "--namespace", release,
                        "--reuse-values", *values, kubeconfig=cluster.kubeconfig)  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr

    upgrade("--set", "rebalancer.enabled=true", "--set", "rebalancer.apply=true")
    try:
        yield release
    finally:
        upgrade("--set", "rebalancer.enabled=false", "--set", "rebalancer.apply=false")


def test_rebalancer_works_with_only_the_charts_identity(
    cluster: Cluster, rebalancer_release: str, tmp_path: Path
) -> None:
    ns = rebalancer_release
    pod = component_pod(cluster, ns, "rebalancer")
    assert pod["spec"]["serviceAccountName"] == "gpudaemon-rebalancer"
    kc = kubeconfig_for(cluster, ns, pod, tmp_path / "rb")
    cfg = chart_config(cluster, ns, "gpudaemon-rebalancer", tmp_path / "rb.yaml")
    listen = f"127.0.0.1:{free_port()}"
    log = tmp_path / "rebalancer.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpudaemon", "rebalance", "--config", str(cfg)],
            env=clean_env(
                POD_NAME=pod["metadata"]["name"],
                GPUDAEMON_KUBERNETES__KUBECONFIG=str(kc),
                GPUDAEMON_REBALANCE__LISTEN=listen,
            ),
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
    try:
        url = f"http://{listen}"
        wait_for(lambda: http_get(url + "/readyz")[0] == 200, 60, what="rebalancer /readyz")
        wait_for(lambda: scrape(url + "/metrics", "gpudaemon_rebalancer_leader") == 1, 60,
                 what="the rebalancer leading")  # fmt: skip
        assert scrape(url + "/metrics", "gpudaemon_rebalancer_dry_run") == 0  # apply: true
        lease = cluster.request("GET", LEASE.format(ns=ns))
        # $POD_NAME plus a per-process suffix: two replicas never share an identity.
        assert lease["spec"]["holderIdentity"].startswith(pod["metadata"]["name"] + "_")
        assert "gpudaemon.io/rebalancer-state" in lease["metadata"]["annotations"]
        wait_for(lambda: scrape(url + "/metrics", "gpudaemon_rebalancer_passes_total") >= 1,
                 60, what="a pass")  # fmt: skip
    finally:
        stop(proc)
    text = log.read_text(errors="replace")
    assert "forbidden" not in text.lower() and "Traceback" not in text, text[-3000:]

    # What it writes in apply mode, with its own token, on a pod in another namespace.
    victim = f"job-{uuid.uuid4().hex[:6]}"
    cluster.request("POST", "/api/v1/namespaces/default/pods", body={
        "metadata": {"name": victim},
        "spec": {"containers": [{"name": "c", "image": "example.invalid/job"}]},
    })  # fmt: skip
    rb = KubeClient.from_credentials(Credentials(in_cluster=False, kubeconfig=str(kc)))
    path = f"/api/v1/namespaces/default/pods/{victim}"
    rb.request("POST", "/api/v1/namespaces/default/events", {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"generateName": f"{victim}.", "namespace": "default"},
        "involvedObject": {"apiVersion": "v1", "kind": "Pod", "namespace": "default",
                           "name": victim},
        "reason": "RebalanceWouldEvict", "message": "chart identity test", "type": "Normal",
        "source": {"component": "gpudaemon-rebalancer"},
    })  # fmt: skip
    patched: dict[str, Any] = rb.request(
        "PATCH", path, {"metadata": {"annotations": {"gpudaemon.io/reserved-node": "gpu-0"}}},
        content_type="application/merge-patch+json",
    )  # fmt: skip
    assert patched["metadata"]["annotations"]["gpudaemon.io/reserved-node"] == "gpu-0"
    rb.request("POST", path + "/eviction", {
        "apiVersion": "policy/v1", "kind": "Eviction",
        "metadata": {"name": victim, "namespace": "default"},
    }, query={"dryRun": "All"})  # fmt: skip
    assert cluster.request("GET", path)["metadata"].get("deletionTimestamp") is None
    # Least privilege: no Secrets, no deleting pods outright.
    for method, p in (("GET", "/api/v1/namespaces/default/secrets"), ("DELETE", path)):
        with pytest.raises(KubeError) as e:
            rb.request(method, p)
        assert e.value.status == 403, (method, p, e.value)
    cluster.request("DELETE", path)
