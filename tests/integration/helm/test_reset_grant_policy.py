"""Who may ask for a GPU reset, with the chart's own identities on a real kube-apiserver:
the release upgraded with `remediation.resetGpu` (and the rebalancer on, applying).

- The rebalancer's token (bound to its pod) may write the reset grant on a Node and
  nothing else there: a label, another annotation, the spec are refused by the
  admission policy <release>-rebalancer-reset-grants.
- An agent's token (bound to its pod) may remove the grant from its own Node, never
  write one: it cannot grant itself a reset through the API.
- The agent may post an Event in `default` (its GPUReset Events), and nowhere else.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpudaemon.errors import KubeError
from gpudaemon.kube.client import Credentials, KubeClient
from tests.integration.helm.cluster import Cluster
from tests.integration.helm.conftest import CHART, run_helm
from tests.integration.helm.test_chart_identities import component_pod, kubeconfig_for

pytestmark = pytest.mark.integration

KEY = "gpudaemon.io/gpu-reset"
MERGE = "application/merge-patch+json"


def client_for(cluster: Cluster, ns: str, component: str, path: Path) -> tuple[KubeClient, str]:
    """A client with the component's pod-bound token, and the node its pod runs on."""
    pod = component_pod(cluster, ns, component)
    kc = kubeconfig_for(cluster, ns, pod, path)
    return (
        KubeClient.from_credentials(Credentials(in_cluster=False, kubeconfig=str(kc))),
        pod["spec"]["nodeName"],
    )


def grant(uuid: str = "GPU-x") -> str:
    now = time.time()
    return json.dumps({"uuid": uuid, "index": 0, "granted_at": now, "until": now + 300})


def refusal(fn: object) -> str:
    """The error text of a write expected to be refused ("" when it was let through)."""
    try:
        fn()  # type: ignore[operator]
    except KubeError as e:
        return str(e)
    return ""


@pytest.fixture(scope="module")
def reset_release(helm: str, cluster: Cluster, release: str) -> Iterator[str]:
    def upgrade(*values: str) -> None:
        proc = run_helm(helm, "upgrade", "gpudaemon", str(CHART), "--namespace", release,
                        "--reuse-values", *values, kubeconfig=cluster.kubeconfig)  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr

    upgrade("--set", "rebalancer.enabled=true", "--set", "rebalancer.apply=true",
            "--set", "remediation.resetGpu=true")  # fmt: skip
    try:
        yield release
    finally:
        upgrade("--set", "rebalancer.enabled=false", "--set", "rebalancer.apply=false",
                "--set", "remediation.resetGpu=false")  # fmt: skip


def test_only_the_rebalancer_grants_and_only_the_agent_takes_a_grant_away(
    cluster: Cluster, reset_release: str, tmp_path: Path
) -> None:
    ns = reset_release
    rb, _ = client_for(cluster, ns, "rebalancer", tmp_path / "rb")
    agent, node = client_for(cluster, ns, "agent", tmp_path / "agent")
    path = f"/api/v1/nodes/{node}"
    try:
        # The policy is loaded asynchronously: wait until a label write is refused.
        def label_refused() -> str:
            text = refusal(lambda: rb.request(
                "PATCH", path, {"metadata": {"labels": {"team": "rb"}}}, content_type=MERGE))  # fmt: skip
            if not text:
                cluster.request("PATCH", path, body={"metadata": {"labels": {"team": None}}},
                                content_type=MERGE)  # fmt: skip
            return text

        text = cluster.wait(label_refused, "the reset-grants policy in force", timeout=60)
        assert "may add, change or remove only the annotation gpudaemon.io/gpu-reset" in text
        # Another annotation, or the spec: refused too.
        text = refusal(lambda: rb.request(
            "PATCH", path, {"metadata": {"annotations": {"x.io/other": "1"}}}, content_type=MERGE))  # fmt: skip
        assert "only the annotation gpudaemon.io/gpu-reset" in text
        text = refusal(lambda: rb.request(
            "PATCH", path, {"spec": {"unschedulable": True}}, content_type=MERGE))  # fmt: skip
        assert "only the annotation gpudaemon.io/gpu-reset" in text
        # Its grant: let through.
        raw = grant()
        rb.request("PATCH", path, {"metadata": {"annotations": {KEY: raw}}}, content_type=MERGE)

        # The agent may not write or change one ...
        text = refusal(lambda: agent.request(
            "PATCH", path, {"metadata": {"annotations": {KEY: grant("GPU-mine")}}},
            content_type=MERGE))  # fmt: skip
        assert "may remove the reset grant gpudaemon.io/gpu-reset, never add or change it" in text
        assert cluster.get(path)["metadata"]["annotations"][KEY] == raw
        # ... but may take it away when its reset is done.
        agent.request("PATCH", path, {"metadata": {"annotations": {KEY: None}}}, content_type=MERGE)
        assert KEY not in (cluster.get(path)["metadata"].get("annotations") or {})
        # Nor grant itself one on a Node without any.
        text = refusal(lambda: agent.request(
            "PATCH", path, {"metadata": {"annotations": {KEY: grant()}}}, content_type=MERGE))  # fmt: skip
        assert "never add or change it" in text

        # The agent's Events: in `default` only.
        event = {"apiVersion": "v1", "kind": "Event", "metadata": {"generateName": f"{node}."},
                 "involvedObject": {"kind": "Node", "name": node}, "reason": "GPUReset",
                 "message": "probe", "type": "Normal"}  # fmt: skip
        agent.request("POST", "/api/v1/namespaces/default/events", event)
        text = refusal(lambda: agent.request("POST", f"/api/v1/namespaces/{ns}/events", event))
        assert "forbidden" in text.lower()
    finally:
        rb.close()
        agent.close()
