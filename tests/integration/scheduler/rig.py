"""A real scheduling rig: etcd + kube-apiserver (ControlPlane), the real agent run once
per test node (simulated GPUs, the agent's restricted identity), the extender
in-process on a real port, and real kube-scheduler processes: `gpudaemon-scheduler`
configured from deploy/scheduler/kube-scheduler-config.yaml, and a plain default one.

Nodes are plain objects (no kubelet): created Ready, with the not-ready taint that
TaintNodesByCondition adds removed by hand. Pods bound but never run count as placed.
"""

from __future__ import annotations

import contextlib
import subprocess
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml

from gpudaemon.agent.app import Agent
from gpudaemon.config import load_config
from gpudaemon.errors import KubeNotFoundError
from gpudaemon.extender.app import Extender
from tests.integration.kube.controlplane import ControlPlane
from tests.support import REPO, ProcessExited, free_port, wait_for

SCHED_CONFIG = REPO / "deploy" / "scheduler" / "kube-scheduler-config.yaml"
GROUP = "gpudaemon.test/group"
NS = "default"


class SchedulerRig:
    def __init__(self, cp: ControlPlane) -> None:
        self.cp = cp
        self.dir = cp.dir
        self.procs: list[subprocess.Popen[bytes]] = []
        self.extender: Extender | None = None

    # -- the extender and the schedulers --------------------------------------------

    def start_extender(self, dra: bool = False, **extender: Any) -> Extender:
        cfg = load_config(
            None,
            environ={},
            overrides={
                "extender": {"listen": "127.0.0.1:0", **extender},
                "dra": {"enabled": dra},
                "kubernetes": {"kubeconfig": str(self.cp.admin_kubeconfig)},
            },
        )
        ext = Extender(cfg)
        ext.start()
        assert ext.wait_synced(60), ext.ready()
        self.extender = ext
        return ext

    def start_scheduler(
        self,
        name: str,
        with_extender: bool,
        url: str | None = None,
        tls: dict[str, str] | None = None,
        conf: dict[str, Any] | None = None,
        binary: str = "kube-scheduler",
        args: Sequence[str] = (),
    ) -> None:
        """`url`: an extender other than the in-process one (a real `gpudaemon
        extender` process); `tls`: kube-scheduler's extender tlsConfig (mutual TLS);
        `conf`: another KubeSchedulerConfiguration than the shipped example (the
        chart's gang one); `binary`: kube-scheduler-plugins for Coscheduling; `args`:
        more flags (the chart's --feature-gates for native gang scheduling)."""
        conf = conf or yaml.safe_load(SCHED_CONFIG.read_text())
        conf["leaderElection"] = {"leaderElect": False}
        conf["clientConnection"] = {"kubeconfig": str(self.cp.admin_kubeconfig)}
        if with_extender:
            if url is None:
                assert self.extender is not None
                url = f"http://127.0.0.1:{self.extender.server.port}"
            conf["extenders"][0]["urlPrefix"] = url
            if tls is not None:
                conf["extenders"][0]["enableHTTPS"] = True
                conf["extenders"][0]["tlsConfig"] = tls
            assert conf["profiles"][0]["schedulerName"] == "gpudaemon-scheduler"
            conf["profiles"][0]["schedulerName"] = name
        else:
            conf.pop("extenders")
            conf["profiles"] = [{"schedulerName": name}]
        path = self.dir / f"scheduler-{name}.yaml"
        path.write_text(yaml.safe_dump(conf))
        port = free_port()
        log = open(self.dir / f"scheduler-{name}.log", "wb")  # noqa: SIM115 - the child's
        proc = subprocess.Popen(
            [
                str(self.cp.bin / binary),
                f"--config={path}",
                f"--secure-port={port}",
                "--bind-address=127.0.0.1",
                f"--authentication-kubeconfig={self.cp.admin_kubeconfig}",
                f"--authorization-kubeconfig={self.cp.admin_kubeconfig}",
                "--v=2",
                *args,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        self.procs.append(proc)

        def healthy() -> bool:
            if proc.poll() is not None:
                raise ProcessExited(self.scheduler_log(name)[-3000:])
            import ssl
            import urllib.request

            ctx = ssl._create_unverified_context()
            with urllib.request.urlopen(f"https://127.0.0.1:{port}/healthz", context=ctx) as r:
                return bool(r.status == 200)

        wait_for(healthy, timeout=60, interval=0.3, what=f"kube-scheduler {name}")

    def scheduler_log(self, name: str) -> str:
        return (self.dir / f"scheduler-{name}.log").read_text(errors="replace")

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(10)
                if p.poll() is None:
                    p.kill()
        if self.extender is not None:
            self.extender.close()

    # -- nodes and agents -----------------------------------------------------------

    def add_node(
        self,
        name: str,
        group: str,
        gpus: int = 8,
        extra: dict[str, str] | None = None,
        cpu: str = "64",
        memory: str = "512Gi",
    ) -> None:
        """`extra`: more allocatable resources (MIG devices, as the device plugin's mixed
        strategy advertises them)."""
        body = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": name, "labels": {GROUP: group, "kubernetes.io/hostname": name}},
            "status": {
                "capacity": {
                    "nvidia.com/gpu": str(gpus),
                    "cpu": cpu,
                    "memory": memory,
                    "pods": "110",
                    **(extra or {}),
                },
                "allocatable": {
                    "nvidia.com/gpu": str(gpus),
                    "cpu": cpu,
                    "memory": memory,
                    "pods": "110",
                    **(extra or {}),
                },
                "conditions": [
                    {"type": "Ready", "status": "True", "reason": "Test", "message": "plain Node"}
                ],
            },
        }
        self.cp.admin.request("POST", "/api/v1/nodes", body=body)
        self.cp.admin.request(
            "PATCH",
            f"/api/v1/nodes/{name}",
            body={"spec": {"taints": None}},
            content_type="application/merge-patch+json",
        )

    def run_agents(
        self,
        nodes: Iterable[str],
        simulate: str = "dgx-h100",
        labels: dict[str, Any] | None = None,
        **kube: Any,
    ) -> None:
        """The real agent, one cycle per node (in threads: it is I/O bound)."""
        errors: list[str] = []

        def one(node: str) -> None:
            cfg = load_config(
                None,
                environ={},
                overrides={
                    "simulate": simulate,
                    "node_name": node,
                    "labels": {"to": "apiserver", **(labels or {})},
                    "kubernetes": {"kubeconfig": str(self.cp.agent_kubeconfig), **kube},
                },
            )
            if Agent(cfg).run(once=True) != 0:
                errors.append(node)

        threads = [threading.Thread(target=one, args=(n,)) for n in nodes]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, f"agent run failed on {errors}"

    def wait_extender_sees(self, nodes: Iterable[str], fresh: bool = True) -> None:
        assert self.extender is not None
        names = list(nodes)
        c = self.extender.cluster

        def seen() -> bool:
            states = c.states(names)
            return all(
                s is not None and s.has_agent_labels and c.fresh(n) == fresh
                for n, s in states.items()
            )

        wait_for(seen, timeout=30, interval=0.1, what=f"extender caches to see {names}")

    # -- pods -----------------------------------------------------------------------

    def create_pod(
        self,
        gpus: int,
        group: str,
        scheduler: str = "gpudaemon-scheduler",
        node: str | None = None,
        name: str | None = None,
        selector: dict[str, str] | None = None,
        labels: dict[str, str] | None = None,
        spec_extra: dict[str, Any] | None = None,
        cpu: str | None = None,
        memory: str | None = None,
        annotations: dict[str, str] | None = None,
    ) -> str:
        """`spec_extra`: more pod spec fields (a native gang's schedulingGroup); `cpu`
        and `memory`: requests (one core and 8 GiB per GPU unless given)."""
        name = name or f"p-{uuid.uuid4().hex[:8]}"
        res: dict[str, Any] = {"cpu": cpu or f"{gpus}", "memory": memory or f"{gpus * 8}Gi"}
        if gpus:
            res["nvidia.com/gpu"] = str(gpus)
        spec: dict[str, Any] = {
            "schedulerName": scheduler,
            "nodeSelector": selector or {GROUP: group},
            "containers": [
                {
                    "name": "c",
                    "image": "example.invalid/x",
                    "resources": {
                        "requests": res,
                        "limits": {k: v for k, v in res.items() if k == "nvidia.com/gpu"},
                    },
                }
            ],
            "terminationGracePeriodSeconds": 0,
        }
        if node:
            spec["nodeName"] = node
        spec.update(spec_extra or {})
        self.cp.admin.request(
            "POST",
            f"/api/v1/namespaces/{NS}/pods",
            body={
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": name,
                    "labels": labels or {},
                    "annotations": annotations or {},
                },
                "spec": spec,
            },
        )
        return name

    def create_mig_pod(
        self, group: str, profile: str, count: int = 1, node: str | None = None
    ) -> str:
        """A pod asking for MIG devices of one profile (limits only, as users write it);
        `node`: bound there at creation (no scheduler involved)."""
        name = f"m-{uuid.uuid4().hex[:8]}"
        spec: dict[str, Any] = {
            "schedulerName": "gpudaemon-scheduler",
            "nodeSelector": {GROUP: group},
            "containers": [
                {
                    "name": "c",
                    "image": "example.invalid/x",
                    "resources": {
                        "requests": {"cpu": "100m", "memory": "1Gi"},
                        "limits": {f"nvidia.com/mig-{profile}": str(count)},
                    },
                }
            ],
            "terminationGracePeriodSeconds": 0,
        }
        if node:
            spec["nodeName"] = node
        self.cp.admin.request(
            "POST",
            f"/api/v1/namespaces/{NS}/pods",
            body={"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec},
        )
        return name

    def requests_by_node(self, nodes: Iterable[str], resource: str) -> dict[str, int]:
        """`resource` requested by the non-terminal pods bound to each node, from the API."""
        out = {n: 0 for n in nodes}
        for p in self.cp.admin.request("GET", f"/api/v1/namespaces/{NS}/pods").get("items") or []:
            node = p["spec"].get("nodeName")
            if node in out:
                for c in p["spec"]["containers"]:
                    res = c.get("resources") or {}
                    v = (res.get("requests") or {}).get(resource) or (res.get("limits") or {}).get(
                        resource, 0
                    )
                    out[node] += int(v)
        return out

    def pod(self, name: str) -> dict[str, Any]:
        return self.cp.admin.request("GET", f"/api/v1/namespaces/{NS}/pods/{name}")

    def wait_bound(self, name: str, timeout: float = 30) -> str:
        def bound() -> str | None:
            return self.pod(name)["spec"].get("nodeName") or None

        return wait_for(bound, timeout=timeout, interval=0.05, what=f"pod {name} bound")

    def delete_pods(self, names: Iterable[str]) -> None:
        for n in names:
            with contextlib.suppress(KubeNotFoundError):
                self.cp.admin.request(
                    "DELETE",
                    f"/api/v1/namespaces/{NS}/pods/{n}",
                    body={"gracePeriodSeconds": 0},
                )

    def events_for(self, pod: str) -> list[str]:
        out = self.cp.admin.request(
            "GET",
            f"/api/v1/namespaces/{NS}/events",
            query={"fieldSelector": f"involvedObject.name={pod}"},
        )
        return [str(e.get("message", "")) for e in out.get("items") or []]

    def gpus_by_node(self, group_nodes: Iterable[str]) -> dict[str, int]:
        """GPU requests of the non-terminal pods bound to each node, from the API."""
        out = {n: 0 for n in group_nodes}
        pods = self.cp.admin.request("GET", f"/api/v1/namespaces/{NS}/pods")
        for p in pods.get("items") or []:
            node = p["spec"].get("nodeName")
            if node in out:
                for c in p["spec"]["containers"]:
                    out[node] += int(
                        ((c.get("resources") or {}).get("requests") or {}).get("nvidia.com/gpu", 0)
                    )
        return out


def wait_seconds(s: float) -> None:
    time.sleep(s)


__all__ = ["GROUP", "Path", "SchedulerRig"]
