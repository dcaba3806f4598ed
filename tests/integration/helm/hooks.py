"""`helm uninstall` with the chart's post-delete cleanup Job, on a cluster with no
kubelet: the test plays the kubelet. It runs exactly what the Job's pod would (the
container's args, as `gpudaemon` in a pod: in-cluster credentials only, a token bound
to that pod of the Job's own ServiceAccount), then reports the pod terminated with the
command's exit code, so the real Job controller completes (or fails) the Job and helm
goes on as it would on a real cluster."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gpudaemon.errors import KubeNotFoundError
from tests.integration.helm.cluster import Cluster
from tests.integration.helm.test_least_privilege import pod_bound_token
from tests.support import REPO, service_account_dir, start_agent_in_pod

CLEANUP = "app.kubernetes.io/component=cleanup"


def uninstall(
    helm: str, cluster: Cluster, release: str, ns: str, tmp: Path, timeout: float = 240
) -> tuple[subprocess.CompletedProcess[str], str]:
    """`helm uninstall` with its hook Job run as described above: (helm's result, the
    Job's output, "" when the release has no Job)."""
    tmp.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-c", _RUN_HELM, helm, str(cluster.kubeconfig), "uninstall", release,
         "-n", ns, "--timeout", f"{int(timeout)}s"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
    )  # fmt: skip
    output = ""
    deadline = time.monotonic() + timeout
    ran: set[str] = set()
    while proc.poll() is None and time.monotonic() < deadline:
        cluster.finish_deletions(ns)
        for pod in cluster.items(f"/api/v1/namespaces/{ns}/pods", CLEANUP):
            name = pod["metadata"]["name"]
            if name in ran or pod["metadata"].get("deletionTimestamp"):
                continue
            ran.add(name)
            rc, out = run_job_pod(cluster, ns, pod, tmp / name)
            output += out
            terminate(cluster, ns, pod, rc)
        time.sleep(0.5)  # the stand-in kubelet's poll interval while helm runs
    try:
        stdout, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
    cluster.finish_deletions(ns)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), output


# helm with the same environment as run_helm, in a child so the test can act meanwhile.
_RUN_HELM = (
    "import sys, pathlib\n"
    "from tests.integration.helm.conftest import run_helm\n"
    "p = run_helm(sys.argv[1], *sys.argv[3:], kubeconfig=pathlib.Path(sys.argv[2]))\n"
    "sys.stdout.write(p.stdout); sys.stderr.write(p.stderr); sys.exit(p.returncode)\n"
)


def run_job_pod(cluster: Cluster, ns: str, pod: dict[str, Any], tmp: Path) -> tuple[int, str]:
    """The pod's one container's args run as `gpudaemon` would in it; (exit code, output)."""
    (container,) = pod["spec"]["containers"]
    token = pod_bound_token(cluster, ns, pod)
    sa = service_account_dir(tmp / "sa", token, cluster.cp.ca, ns)
    log = tmp / "log"
    p = start_agent_in_pod(container["args"], sa, cluster.cp.server, log=log)
    try:
        rc = p.wait(120)
    except subprocess.TimeoutExpired:
        p.kill()
        rc = p.wait()
    return rc, log.read_text()


def terminate(cluster: Cluster, ns: str, pod: dict[str, Any], rc: int) -> None:
    """Report the pod's container terminated with `rc`, as its kubelet would."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    (container,) = pod["spec"]["containers"]
    status = {
        "phase": "Succeeded" if rc == 0 else "Failed",
        "containerStatuses": [{
            "name": container["name"], "image": container["image"], "imageID": "",
            "ready": False, "restartCount": 0,
            "state": {"terminated": {"exitCode": rc, "reason": "Completed" if rc == 0
                                     else "Error", "startedAt": now, "finishedAt": now}},
        }],
    }  # fmt: skip
    with contextlib.suppress(KubeNotFoundError):
        cluster.request(
            "PATCH",
            f"/api/v1/namespaces/{ns}/pods/{pod['metadata']['name']}/status",
            body={"status": status},
            content_type="application/merge-patch+json",
        )
