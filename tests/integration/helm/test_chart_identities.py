"""The installed chart's three identities and configurations, really used: the agent,
the extender and the second kube-scheduler each run as a real process with a token of
the chart's own ServiceAccount, bound to the pod the chart created for it, and with the
configuration from the chart's own ConfigMap. A GPU pod that asks for
`schedulerName: gpudaemon-scheduler` is then placed through the extender, with no
permission error anywhere: the chart's RBAC is enough, and its configs load."""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.helm.cluster import Cluster
from tests.integration.helm.conftest import GPU_NODES
from tests.integration.helm.test_least_privilege import pod_bound_token
from tests.integration.kube.controlplane import _kubeconfig
from tests.support import REPO, free_port, http_get, wait_for

pytestmark = pytest.mark.integration


def component_pod(cluster: Cluster, ns: str, component: str) -> dict[str, Any]:
    selector = f"app.kubernetes.io/instance=gpudaemon,app.kubernetes.io/component={component}"
    return dict(
        cluster.wait(
            lambda: next(
                (
                    p
                    for p in cluster.items(f"/api/v1/namespaces/{ns}/pods", selector)
                    if p["spec"].get("nodeName")
                ),
                None,
            ),
            f"a bound {component} pod",
        )
    )


def kubeconfig_for(cluster: Cluster, ns: str, pod: dict[str, Any], path: Path) -> Path:
    token = pod_bound_token(cluster, ns, pod)
    return _kubeconfig(
        path, cluster.cp.server, pod["spec"]["serviceAccountName"], token, cluster.cp.ca
    )


def chart_config(cluster: Cluster, ns: str, name: str, path: Path) -> Path:
    cm = cluster.request("GET", f"/api/v1/namespaces/{ns}/configmaps/{name}")
    path.write_text(cm["data"]["config.yaml"])
    return path


def clean_env(**extra: str) -> dict[str, str]:
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("GPUDAEMON_", "KUBE"))}
    return {**keep, **extra}


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def test_agent_extender_and_scheduler_work_with_only_the_charts_identities(
    cluster: Cluster,
    release: str,
    tmp_path: Path,
    processes: list[subprocess.Popen[bytes]],
) -> None:
    ns = release
    # 1. The agent on every GPU node: the chart's config file, its pod's token.
    agent_cfg = chart_config(cluster, ns, "gpudaemon-agent", tmp_path / "agent.yaml")
    agents = {str(p["spec"]["nodeName"]): p for p in cluster.items(
        f"/api/v1/namespaces/{ns}/pods", "app.kubernetes.io/instance=gpudaemon,app.kubernetes.io/component=agent"
    )}  # fmt: skip
    for node in GPU_NODES:
        kc = kubeconfig_for(cluster, ns, agents[node], tmp_path / f"agent-{node}")
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "gpudaemon",
                "run",
                "--config",
                str(agent_cfg),
                "--simulate",
                "dgx-h100",
                "--once",
            ],
            env=clean_env(NODE_NAME=node, GPUDAEMON_KUBERNETES__KUBECONFIG=str(kc)),
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=120,
        )
        assert run.returncode == 0, run.stdout + run.stderr
        assert cluster.get(f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases/{node}")

    # 2. The extender: the chart's config, the token of the pod it runs in (the
    # scheduler's: the extender is its sidecar, issue 17).
    sched_pod = component_pod(cluster, ns, "scheduler")
    assert [c["name"] for c in sched_pod["spec"]["containers"]] == ["kube-scheduler", "extender"]
    ext_kc = kubeconfig_for(cluster, ns, sched_pod, tmp_path / "ext")
    ext_port = free_port()
    ext_log = tmp_path / "extender.log"
    with open(ext_log, "wb") as log:
        processes.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "gpudaemon",
                    "extender",
                    "--config",
                    str(chart_config(cluster, ns, "gpudaemon-extender", tmp_path / "ext.yaml")),
                ],
                env=clean_env(
                    GPUDAEMON_KUBERNETES__KUBECONFIG=str(ext_kc),
                    GPUDAEMON_EXTENDER__LISTEN=f"127.0.0.1:{ext_port}",
                    GPUDAEMON_EXTENDER__METRICS_LISTEN=f"127.0.0.1:{free_port()}",
                ),
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO,
            )
        )
    wait_for(
        lambda: http_get(f"http://127.0.0.1:{ext_port}/readyz")[0] == 200,
        timeout=60,
        what="extender /readyz",
    )

    # 3. The second scheduler: the chart's KubeSchedulerConfiguration (leader election
    # on, as shipped), the scheduler pod's token for the API and for its delegated
    # authentication and authorization.
    sched_kc = kubeconfig_for(cluster, ns, sched_pod, tmp_path / "s")
    conf = yaml.safe_load(
        cluster.request("GET", f"/api/v1/namespaces/{ns}/configmaps/gpudaemon-scheduler")["data"][
            "config.yaml"
        ]
    )
    assert conf["leaderElection"]["leaderElect"] is True
    conf["clientConnection"] = {"kubeconfig": str(sched_kc)}
    assert conf["extenders"][0]["urlPrefix"] == "http://127.0.0.1:9446"  # loopback: the sidecar
    conf["extenders"][0]["urlPrefix"] = f"http://127.0.0.1:{ext_port}"
    (tmp_path / "sched.yaml").write_text(yaml.safe_dump(conf))
    sched_port = free_port()
    sched_log = tmp_path / "scheduler.log"
    with open(sched_log, "wb") as log:
        processes.append(
            subprocess.Popen(
                [
                    str(cluster.bin / "kube-scheduler"),
                    f"--config={tmp_path / 'sched.yaml'}",
                    f"--secure-port={sched_port}",
                    "--bind-address=127.0.0.1",
                    f"--authentication-kubeconfig={sched_kc}",
                    f"--authorization-kubeconfig={sched_kc}",
                    "--v=2",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )

    def healthy() -> bool:
        ctx = ssl._create_unverified_context()
        url = f"https://127.0.0.1:{sched_port}/healthz"
        with urllib.request.urlopen(url, context=ctx, timeout=5) as r:
            return bool(r.status == 200)

    wait_for(healthy, timeout=60, interval=0.5, what="kube-scheduler /healthz")
    lease = cluster.wait(
        lambda: cluster.get(
            f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases/gpudaemon-scheduler"
        ),
        "the scheduler's leader-election Lease",
    )
    assert lease["spec"]["holderIdentity"]

    # 4. A GPU pod for the second scheduler is placed on a GPU node.
    name = f"train-{uuid.uuid4().hex[:6]}"
    gpu = {"nvidia.com/gpu": "2"}
    cluster.request(
        "POST",
        "/api/v1/namespaces/default/pods",
        body={
            "metadata": {"name": name},
            "spec": {
                "schedulerName": "gpudaemon-scheduler",
                "containers": [
                    {
                        "name": "c",
                        "image": "example.invalid/train",
                        "resources": {"requests": gpu, "limits": gpu},
                    }
                ],
            },
        },
    )
    node = cluster.wait(
        lambda: cluster.request("GET", f"/api/v1/namespaces/default/pods/{name}")["spec"].get(
            "nodeName"
        ),
        f"pod {name} bound by gpudaemon-scheduler",
        timeout=60,
    )
    assert node in GPU_NODES
    events = cluster.items("/api/v1/namespaces/default/events")
    assert any(
        e["involvedObject"]["name"] == name
        and e.get("reportingComponent", e.get("source", {}).get("component"))
        == "gpudaemon-scheduler"
        for e in events
    ), [e.get("reportingComponent") for e in events]

    # 5. Nothing was refused along the way.
    for log_path in (sched_log, ext_log):
        text = log_path.read_text(errors="replace")
        assert "forbidden" not in text.lower(), text[-3000:]
