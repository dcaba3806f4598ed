"""The chart's rebalancer, really used with only what the chart gives it (issue 22): the
release upgraded with `rebalancer.enabled` and `apply`, the rebalancer run as a real
process with its ConfigMap and a token of its own ServiceAccount bound to the pod the
chart's Deployment created, and `POD_NAME` from that pod as the downward API gives it.
It takes its Lease and lists what it watches; then each write it makes in apply mode
(an Event, the reservation patch, a dryRun eviction) is made with that token on a pod
in another namespace, and a Secret read is refused. Nothing is forbidden along the way.

Then what a stolen token of it cannot do (issue 28): change any field of any pod but
its two reservation annotations, on a pending pod of the gpudaemon scheduler (the
admission policy <release>-rebalancer-pod-writes), or write any Lease but its own.
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
SCHEDULER = "gpudaemon-scheduler"
MERGE = "application/merge-patch+json"
RESERVATION = {"gpudaemon.io/reserved-node": "gpu-1", "gpudaemon.io/reserved-until": "1900000000"}


def make_pod(cluster: Cluster, ns: str, name: str, scheduler: str = "", node: str = "") -> str:
    """A pod as the API server stores it; pending unless `node` binds it at creation."""
    spec: dict[str, Any] = {"containers": [{"name": "c", "image": "example.invalid/job"}]}
    if scheduler:
        spec["schedulerName"] = scheduler
    if node:
        spec["nodeName"] = node
    cluster.request("POST", f"/api/v1/namespaces/{ns}/pods",
                    body={"metadata": {"name": name, "labels": {"app": "job"}}, "spec": spec})  # fmt: skip
    return f"/api/v1/namespaces/{ns}/pods/{name}"


def rebalancer_client(cluster: Cluster, ns: str, tmp_path: Path) -> KubeClient:
    """Its ServiceAccount's token bound to the pod the chart's Deployment made."""
    pod = component_pod(cluster, ns, "rebalancer")
    kc = kubeconfig_for(cluster, ns, pod, tmp_path / "rb")
    return KubeClient.from_credentials(Credentials(in_cluster=False, kubeconfig=str(kc)))


@pytest.fixture(scope="module")
def rebalancer_release(
    helm: str, cluster: Cluster, release: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """The session's release with the rebalancer on (apply), and off again afterwards;
    returned once its pod-writes policy is in force (the API server loads a new policy
    asynchronously: until then nothing is refused)."""

    def upgrade(*values: str) -> None:
        proc = run_helm(helm, "upgrade", "gpudaemon", str(CHART), "--namespace", release,
                        "--reuse-values", *values, kubeconfig=cluster.kubeconfig)  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr

    upgrade("--set", "rebalancer.enabled=true", "--set", "rebalancer.apply=true")
    try:
        wait_for_pod_policy(cluster, release, tmp_path_factory.mktemp("probe"))
        yield release
    finally:
        upgrade("--set", "rebalancer.enabled=false", "--set", "rebalancer.apply=false")


def wait_for_pod_policy(cluster: Cluster, ns: str, tmp_path: Path) -> None:
    probe = make_pod(cluster, ns, f"policy-probe-{uuid.uuid4().hex[:6]}", SCHEDULER)
    rb = rebalancer_client(cluster, ns, tmp_path)

    def refused() -> bool:
        try:
            rb.request("PATCH", probe, {"metadata": {"labels": {"app": uuid.uuid4().hex[:6]}}},
                       content_type=MERGE)  # fmt: skip
        except KubeError as e:
            return "gpudaemon rebalancer may not change" in str(e)
        return False

    try:
        cluster.wait(refused, "the rebalancer's pod-writes policy in force", timeout=60)
    finally:
        rb.close()
        cluster.request("DELETE", probe, query={"gracePeriodSeconds": "0"})


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
    make_pod(cluster, "default", victim, SCHEDULER)  # pending: nothing runs that scheduler
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


def refused(rb: KubeClient, method: str, path: str, body: Any, ctype: str = MERGE) -> str:
    with pytest.raises(KubeError) as e:
        rb.request(method, path, body, content_type=ctype)
    assert e.value.status in (403, 422), (method, path, body, e.value)
    return str(e.value)


def test_rebalancer_token_writes_only_its_reservation_on_pending_pods_of_its_scheduler(
    cluster: Cluster, rebalancer_release: str, tmp_path: Path
) -> None:
    ns = rebalancer_release
    tag = uuid.uuid4().hex[:6]
    pending = make_pod(cluster, "default", f"pending-{tag}", SCHEDULER)
    other = make_pod(cluster, "default", f"other-{tag}", "another-scheduler")
    bound = make_pod(cluster, "default", f"bound-{tag}", SCHEDULER, node="cpu-0")
    system = make_pod(cluster, "kube-system", f"system-{tag}", node="cpu-1")
    before = {p: cluster.request("GET", p) for p in (pending, other, bound, system)}
    rb = rebalancer_client(cluster, ns, tmp_path)
    try:
        # What it does: its two annotations on a pending pod of its scheduler, set and
        # removed with a merge patch (an UPDATE to admission), and evictions.
        done = rb.request("PATCH", pending, {"metadata": {"annotations": RESERVATION}},
                          content_type=MERGE)  # fmt: skip
        assert {k: done["metadata"]["annotations"][k] for k in RESERVATION} == RESERVATION
        clear = {k: None for k in RESERVATION}
        rb.request("PATCH", pending, {"metadata": {"annotations": clear}}, content_type=MERGE)

        only = "may add, change or remove only the annotations gpudaemon.io/reserved-node"
        not_spec = "may not change a pod's spec, labels, owner references, finalizers or status"
        gone = {"apiVersion": "v1", "kind": "ConfigMap", "name": "gone", "uid": str(uuid.uuid4())}
        image = [{"op": "replace", "path": "/spec/containers/0/image", "value": "evil.example/x"}]
        # An update may add tolerations (the API server's own pod validation allows it).
        tolerate = [{"op": "add", "path": "/spec/tolerations/-", "value": {"operator": "Exists"}}]
        for body, ctype, msg in [
            (image, "application/json-patch+json", not_spec),
            ({"spec": {"activeDeadlineSeconds": 1}}, MERGE, not_spec),
            (tolerate, "application/json-patch+json", not_spec),
            ({"metadata": {"labels": {"app": "evil"}}}, MERGE, not_spec),
            ({"metadata": {"ownerReferences": [gone]}}, MERGE, not_spec),
            ({"metadata": {"finalizers": ["example.com/hold"]}}, MERGE, not_spec),
            ({"metadata": {"annotations": {"example.com/x": "1"}}}, MERGE, only),
            ({"metadata": {"annotations": {**RESERVATION, "gpudaemon.io/rebalance": "true"}}},
             MERGE, only),
            ({"metadata": {"annotations": RESERVATION, "labels": {"app": "evil"}}}, MERGE, not_spec),
        ]:  # fmt: skip
            assert msg in refused(rb, "PATCH", pending, body, ctype), body
        # A bound pod, another scheduler's pod, kube-system's: not even the reservation.
        pending_only = f"may annotate only pending pods of the scheduler {SCHEDULER}"
        for path in (bound, other, system):
            body = {"metadata": {"annotations": RESERVATION}}
            assert pending_only in refused(rb, "PATCH", path, body), path
        assert pending_only in refused(rb, "PATCH", system, image, "application/json-patch+json")
        # No other verb or subresource (RBAC): update, status, ephemeral containers,
        # create, delete.
        eph = {"spec": {"ephemeralContainers": [
            {"name": "debug", "image": "evil.example/x", "targetContainerName": "c"}]}}  # fmt: skip
        for method, path, body in [
            ("PUT", pending, before[pending]),
            ("PATCH", pending + "/status", {"status": {"phase": "Failed"}}),
            ("PATCH", pending + "/ephemeralcontainers", eph),
            ("POST", "/api/v1/namespaces/default/pods", {"metadata": {"name": "x"}}),
            ("DELETE", pending, None),
        ]:
            assert "cannot" in refused(rb, method, path, body), (method, path)  # RBAC's 403
        # Nor a Lease other than its own (a node's missing freshness Lease, say).
        lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                 "metadata": {"name": "cpu-0", "namespace": ns}, "spec": {"holderIdentity": "x"}}  # fmt: skip
        msg = refused(rb, "POST", f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases",
                      lease, "application/json")  # fmt: skip
        assert "may write only its own Lease, gpudaemon-rebalancer" in msg
        # Every pod as it was (its resourceVersion and managedFields aside: the allowed
        # patches above were writes).
        for path, old in before.items():
            now = cluster.request("GET", path)
            for key in ("resourceVersion", "managedFields"):
                now["metadata"].pop(key, None)
                old["metadata"].pop(key, None)
            assert now == old, path
        assert not any(k in (cluster.request("GET", pending)["metadata"].get("annotations") or {})
                       for k in RESERVATION)  # fmt: skip
        # Its one way to remove a pod stays: the Eviction API.
        rb.request("POST", bound + "/eviction", {
            "apiVersion": "policy/v1", "kind": "Eviction",
            "metadata": {"name": f"bound-{tag}", "namespace": "default"},
        })  # fmt: skip
        assert cluster.request("GET", bound)["metadata"].get("deletionTimestamp")
    finally:
        rb.close()
        for path in before:
            if cluster.get(path):
                cluster.request("DELETE", path, query={"gracePeriodSeconds": "0"})
