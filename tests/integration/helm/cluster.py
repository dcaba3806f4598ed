"""A kubelet-less cluster for the chart: the kube tests' etcd + kube-apiserver, plus a
real kube-controller-manager (only the controllers `helm install` needs) and a real
kube-scheduler, and Nodes that are plain API objects.

No kubelet runs, so pods are bound but never start. Two things a kubelet would do are
done here instead, and say so where they happen: mark new Nodes Ready (and lift the
not-ready taint that admission put on them), and finish deleting pods whose deletion
has begun (a kubelet confirms a bound pod's graceful delete once its containers stop).
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import yaml

from gpudaemon.errors import KubeNotFoundError
from tests.integration.kube.controlplane import ControlPlane
from tests.support import free_port, wait_for

# Only what a DaemonSet, Deployments and `helm uninstall` (its cleanup Job) need.
# Without the node lifecycle controller nobody marks the kubelet-less Nodes unreachable.
CONTROLLERS = "daemonset,deployment,replicaset,garbagecollector,job"
GPU_LABEL = {"nvidia.com/gpu.present": "true"}


class Cluster:
    def __init__(self, bin_dir: Path) -> None:
        self.bin = bin_dir
        self.cp = ControlPlane(bin_dir)
        self.dir = self.cp.dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self) -> Cluster:
        self.cp.start()
        kc = str(self.cp.admin_kubeconfig)
        self._spawn(
            "kube-controller-manager",
            [
                f"--kubeconfig={kc}",
                f"--controllers={CONTROLLERS}",
                "--leader-elect=false",
                "--secure-port=0",
                "--concurrent-gc-syncs=5",
                "--v=1",
            ],
        )
        sched = self.dir / "scheduler.yaml"
        sched.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "kubescheduler.config.k8s.io/v1",
                    "kind": "KubeSchedulerConfiguration",
                    "clientConnection": {"kubeconfig": kc},
                    "leaderElection": {"leaderElect": False},
                }
            )
        )
        self._spawn(
            "kube-scheduler",
            [f"--config={sched}", f"--secure-port={free_port()}", "--bind-address=127.0.0.1"],
        )
        return self

    def _spawn(self, name: str, args: list[str]) -> None:
        with open(self.dir / f"{name}.log", "wb") as log:
            self.procs[name] = subprocess.Popen(
                [str(self.bin / name), *args], stdout=log, stderr=subprocess.STDOUT
            )

    def check_alive(self) -> None:
        for name, p in self.procs.items():
            if p.poll() is not None:
                tail = (self.dir / f"{name}.log").read_text()[-3000:]
                raise AssertionError(f"{name} exited {p.returncode}:\n{tail}")

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.cp.stop()

    # -- objects -------------------------------------------------------------------

    @property
    def kubeconfig(self) -> Path:
        return self.cp.admin_kubeconfig

    def request(self, method: str, path: str, **kw: Any) -> dict[str, Any]:
        return self.cp.admin.request(method, path, **kw)

    def get(self, path: str) -> dict[str, Any] | None:
        try:
            return self.request("GET", path)
        except KubeNotFoundError:
            return None

    def items(self, path: str, selector: str = "") -> list[dict[str, Any]]:
        query = {"labelSelector": selector} if selector else None
        return list(self.request("GET", path, query=query).get("items") or [])

    def add_node(self, name: str, gpus: int) -> None:
        """A Node as a kubelet would register it: capacity, Ready, and no taint."""
        capacity = {"cpu": "16", "memory": "64Gi", "pods": "110"}
        if gpus:
            capacity["nvidia.com/gpu"] = str(gpus)
        self.request(
            "POST",
            "/api/v1/nodes",
            body={"metadata": {"name": name, "labels": GPU_LABEL if gpus else {}}},
        )
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        ready = {
            "type": "Ready",
            "status": "True",
            "reason": "KubeletReady",
            "lastHeartbeatTime": now,
            "lastTransitionTime": now,
        }
        self.request(
            "PATCH",
            f"/api/v1/nodes/{name}/status",
            body={"status": {"capacity": capacity, "allocatable": capacity, "conditions": [ready]}},
            content_type="application/merge-patch+json",
        )
        # TaintNodesByCondition tainted it not-ready at creation; the node lifecycle
        # controller would lift that now that it is Ready, and it is not running.
        self.request(
            "PATCH",
            f"/api/v1/nodes/{name}",
            body={"spec": {"taints": None}},
            content_type="application/merge-patch+json",
        )

    def finish_deletions(self, namespace: str) -> int:
        """Complete graceful deletes of bound pods, as their kubelet would."""
        n = 0
        for pod in self.items(f"/api/v1/namespaces/{namespace}/pods"):
            if pod["metadata"].get("deletionTimestamp"):
                try:
                    self.request(
                        "DELETE",
                        f"/api/v1/namespaces/{namespace}/pods/{pod['metadata']['name']}",
                        query={"gracePeriodSeconds": "0"},
                    )
                    n += 1
                except KubeNotFoundError:
                    pass
        return n

    def wait(self, fn: Any, what: str, timeout: float = 90) -> Any:
        def step() -> Any:
            self.check_alive()
            return fn()

        return wait_for(step, timeout=timeout, interval=0.5, what=what)
