"""The rebalancer's Lease is the rebalancer's alone: with the chart installed (rebalancer
off, as by default), a token of the scheduler's ServiceAccount, bound to the pod the
chart made, may still write Leases (its own leader election), but creating the Lease
gpudaemon-rebalancer is refused by the admission policy
<release>-scheduler-no-rebalancer-lease, so it cannot keep room on the extender for
anyone."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from gpudaemon.errors import KubeError
from gpudaemon.kube.client import Credentials, KubeClient
from tests.integration.helm.cluster import Cluster
from tests.integration.helm.test_chart_identities import component_pod, kubeconfig_for

pytestmark = pytest.mark.integration

LEASES = "/apis/coordination.k8s.io/v1/namespaces/{ns}/leases"


def lease(name: str) -> dict[str, Any]:
    """The Lease as the attack wrote it: renewTime 2099, a duration of 2**31 - 1 s."""
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {
            "name": name,
            "annotations": {"gpudaemon.io/reservations": '[{"uid":"x","pod":"t/x","node":"n",'
                            '"gpus":8,"priority":0,"until":4102444800}]'},
        },
        "spec": {"holderIdentity": "forged", "leaseDurationSeconds": 2**31 - 1,
                 "renewTime": "2099-01-01T00:00:00.000000Z"},
    }  # fmt: skip


def test_the_schedulers_identity_cannot_create_the_rebalancers_lease(
    cluster: Cluster, release: str, tmp_path: Path
) -> None:
    ns = release
    pod = component_pod(cluster, ns, "scheduler")
    kc = kubeconfig_for(cluster, ns, pod, tmp_path / "sched")
    sched = KubeClient.from_credentials(Credentials(in_cluster=False, kubeconfig=str(kc)))
    path = LEASES.format(ns=ns)
    # A rebalancer of an earlier test in this cluster may have left its (released) Lease.
    if cluster.get(f"{path}/gpudaemon-rebalancer") is not None:
        cluster.request("DELETE", f"{path}/gpudaemon-rebalancer")
    try:
        # Its own kind of write still works: any other Lease name.
        other = f"probe-{uuid.uuid4().hex[:6]}"
        sched.request("POST", path, lease(other))
        cluster.request("DELETE", f"{path}/{other}")

        def refused() -> str:
            """The refusal's text; a create let through before the API server has
            loaded the new policy is undone and tried again."""
            try:
                sched.request("POST", path, lease("gpudaemon-rebalancer"))
            except KubeError as e:
                return str(e) if e.status in (403, 422) else ""
            cluster.request("DELETE", f"{path}/gpudaemon-rebalancer")
            return ""

        text = cluster.wait(refused, "the scheduler's create of the Lease refused", timeout=60)
        assert "only the gpudaemon rebalancer may write the Lease" in text, text
        assert cluster.get(f"{path}/gpudaemon-rebalancer") is None
    finally:
        sched.close()
