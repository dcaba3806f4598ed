"""The rebalancer's cluster: the scheduler rig (etcd, kube-apiserver, the extender and
the real gpudaemon-scheduler) plus a real kube-controller-manager running the
ReplicaSet, Deployment, disruption (PodDisruptionBudget status) and garbage-collector
controllers, real agents, and real `gpudaemon rebalance` processes.

No kubelet runs. What a kubelet and the NVIDIA device plugin would do is done by
`KubeletStandIn`, and only that: it marks bound pods Running and Ready (without which
the Eviction API ignores PodDisruptionBudgets, as it does for pods that never ran),
finishes the deletion of pods being deleted, and hands each bound GPU pod healthy GPUs
of its node, which it serves over the real pod-resources gRPC API the agent reads.
"""

from __future__ import annotations

import contextlib
import subprocess
import threading
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from gpudaemon.agent.app import Agent
from gpudaemon.config import load_config
from gpudaemon.errors import KubeError
from tests.integration.kube.controlplane import ADMISSION, RBAC, ControlPlane
from tests.integration.podresources.fake_kubelet import KubeletServer, pod
from tests.integration.scheduler.rig import GROUP, NS, SchedulerRig
from tests.support import ProcessExited, free_port, http_get, scrape, start_agent, stop, wait_for

CONTROLLERS = "replicaset,deployment,disruption,garbagecollector"
P = "gpudaemon.io/"
OPT_IN = {"gpudaemon.io/rebalance": "true"}


class KubeletStandIn:
    """One thread for every node of the rig (see the module docstring)."""

    def __init__(self, rig: RebalanceRig) -> None:
        self.rig = rig
        self.kubelets: dict[str, KubeletServer] = {}  # node -> pod-resources server
        self.assigned: dict[str, tuple[str, list[int]]] = {}  # pod uid -> (node, GPUs)
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="kubelet-stand-in", daemon=True)

    def serve(self, node: str, socket: Path) -> None:
        self.kubelets[node] = KubeletServer(socket)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(10)
        for k in self.kubelets.values():
            k.stop()

    def _loop(self) -> None:
        while not self.stop_event.wait(0.3):
            try:
                self._once()
            except KubeError:
                pass  # a pod deleted under us: next round
            except Exception:  # a bug here must show, not stop the stand-in silently
                traceback.print_exc()

    def _once(self) -> None:
        admin = self.rig.cp.admin
        pods = admin.request("GET", f"/api/v1/namespaces/{NS}/pods").get("items") or []
        live = set()
        for p in pods:
            meta, spec = p["metadata"], p["spec"]
            if meta.get("deletionTimestamp"):  # the containers "stopped": finish the delete
                with contextlib.suppress(KubeError):
                    admin.request("DELETE", f"/api/v1/namespaces/{NS}/pods/{meta['name']}",
                                  body={"gracePeriodSeconds": 0})  # fmt: skip
                continue
            if not spec.get("nodeName"):
                continue
            live.add(meta["uid"])
            if meta["uid"] not in self.assigned:
                self._allocate(p)
            if (p.get("status") or {}).get("phase") != "Running":
                ready = [{"type": t, "status": "True"} for t in ("Ready", "ContainersReady")]
                admin.request(
                    "PATCH",
                    f"/api/v1/namespaces/{NS}/pods/{meta['name']}/status",
                    body={"status": {"phase": "Running", "conditions": ready}},
                    content_type="application/strategic-merge-patch+json",
                )
        for uid in set(self.assigned) - live:
            del self.assigned[uid]
        self._publish(pods)

    def _allocate(self, p: dict[str, Any]) -> None:
        """The device plugin's part: healthy GPUs nobody holds, lowest index first."""
        node = p["spec"]["nodeName"]
        want = sum(
            int(((c.get("resources") or {}).get("limits") or {}).get("nvidia.com/gpu", 0))
            for c in p["spec"]["containers"]
        )
        agent = self.rig.agents.get(node)
        if agent is None or want == 0:
            self.assigned[p["metadata"]["uid"]] = (node, [])
            return
        held = {i for n, idx in self.assigned.values() if n == node for i in idx}
        snap = agent.cache.get()
        sick = {s.index for s in snap.samples if not s.healthy}
        free = [i for i in range(8) if i not in held and i not in sick]
        self.assigned[p["metadata"]["uid"]] = (node, free[:want])

    def _publish(self, pods: list[dict[str, Any]]) -> None:
        by_uid = {p["metadata"]["uid"]: p for p in pods}
        for node, server in self.kubelets.items():
            agent = self.rig.agents[node]
            inv = agent.cache.get().inventory
            if inv is None:
                continue
            uuids = [g.uuid for g in inv.gpus]
            server.servicer.pods = [
                pod(by_uid[uid]["metadata"]["name"], NS,
                    ("c", {"nvidia.com/gpu": [uuids[i] for i in idx]}))
                for uid, (n, idx) in self.assigned.items()
                if n == node and idx and uid in by_uid
            ]  # fmt: skip


class RebalanceRig(SchedulerRig):
    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.agents: dict[str, Agent] = {}
        self.agent_threads: list[threading.Thread] = []
        self.kubelet = KubeletStandIn(self)
        self.rebalancers: dict[str, tuple[subprocess.Popen[bytes], str]] = {}

    def start_controller_manager(self, controllers: str = CONTROLLERS) -> None:
        log = open(self.dir / "kube-controller-manager.log", "wb")  # noqa: SIM115 - the child's
        self.procs.append(
            subprocess.Popen(
                [
                    str(self.cp.bin / "kube-controller-manager"),
                    f"--kubeconfig={self.cp.admin_kubeconfig}",
                    f"--controllers={controllers}",
                    "--leader-elect=false",
                    "--secure-port=0",
                    "--v=1",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )

    def live_agent(self, node: str, simulate: str = "dgx-h100", **more: Any) -> Agent:
        """The real agent, running on its cron schedules (every second here), with the
        stand-in's pod-resources socket: it publishes which pod holds which GPU. `more`:
        more configuration sections (remediation)."""
        socket = self.dir / f"kubelet-{node}.sock"
        self.kubelet.serve(node, socket)
        cfg = load_config(
            None,
            environ={},
            overrides={
                "simulate": simulate,
                "node_name": node,
                "labels": {"to": "apiserver"},
                "schedules": {"telemetry": "* * * * * *", "labels": "* * * * * *",
                              "pods": "* * * * * *"},
                "metrics": {"listen": "127.0.0.1:0", "pod_resources_socket": str(socket)},
                "health": {"state_file": ""},
                "kubernetes": {"kubeconfig": str(self.cp.agent_kubeconfig)},
                **more,
            },
        )  # fmt: skip
        agent = Agent(cfg)
        self.agents[node] = agent
        t = threading.Thread(target=agent.run, name=f"agent-{node}", daemon=True)
        t.start()
        self.agent_threads.append(t)
        wait_for(lambda: self.cp.lease(node), 30, what=f"{node}'s Lease")
        return agent

    def start_rebalancer(self, name: str, apply: bool, dra: bool = False,
                         remediation: dict[str, Any] | None = None, **rebalance: Any) -> str:  # fmt: skip
        """A real `gpudaemon rebalance` process; returns its metrics URL. `dra`: the
        `dra.enabled` switch; `remediation`: that section."""
        addr = f"127.0.0.1:{free_port()}"
        cfg = self.dir / f"rebalance-{name}.yaml"
        conf = {"interval_s": 1, "grace_s": 2, "lease_duration_s": 6, **rebalance}
        cfg.write_text(
            yaml.safe_dump(
                {
                    **({"remediation": remediation} if remediation else {}),
                    "rebalance": conf,
                    "extender": {"policy": "binpack"},
                    "dra": {"enabled": dra},
                    "kubernetes": {"kubeconfig": str(self.cp.admin_kubeconfig)},
                    "logging": {"level": "DEBUG"},
                }
            )
        )
        args = ["rebalance", "--config", str(cfg), "--listen", addr, "--identity", name]
        proc = start_agent([*args, "--apply"] if apply else args,
                           log=self.dir / f"rebalance-{name}.log")  # fmt: skip
        url = f"http://{addr}"
        self.rebalancers[name] = (proc, url)

        def ready() -> bool:
            if proc.poll() is not None:
                raise ProcessExited(self.rebalancer_log(name)[-3000:])
            return http_get(url + "/readyz")[0] == 200

        wait_for(ready, 60, interval=0.2, what=f"rebalancer {name} ready")
        return url

    def rebalancer_log(self, name: str) -> str:
        return (self.dir / f"rebalance-{name}.log").read_text(errors="replace")

    def stop_rebalancers(self) -> None:
        for proc, _ in self.rebalancers.values():
            stop(proc)
        self.rebalancers.clear()
        with contextlib.suppress(KubeError):  # the next test starts its own election
            self.cp.admin.request(
                "DELETE",
                "/apis/coordination.k8s.io/v1/namespaces/gpudaemon/leases/gpudaemon-rebalancer",
            )

    def stop(self) -> None:
        self.stop_rebalancers()
        for a in self.agents.values():
            a.stop_event.set()
        for t in self.agent_threads:
            t.join(15)
        self.kubelet.stop()
        super().stop()

    # -- objects ----------------------------------------------------------------------

    def deployment(self, name: str, replicas: int, gpus: int, group: str,
                   opt_in: bool = False) -> None:  # fmt: skip
        labels = {"app": name}
        res = {"cpu": "1", "memory": "8Gi", "nvidia.com/gpu": str(gpus)}
        self.cp.admin.request(
            "POST",
            f"/apis/apps/v1/namespaces/{NS}/deployments",
            body={
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "metadata": {"name": name},
                "spec": {
                    "replicas": replicas,
                    "selector": {"matchLabels": labels},
                    "template": {
                        "metadata": {
                            "labels": labels,
                            "annotations": OPT_IN if opt_in else {},
                        },
                        "spec": {
                            "schedulerName": "gpudaemon-scheduler",
                            "nodeSelector": {GROUP: group},
                            "terminationGracePeriodSeconds": 0,
                            "containers": [
                                {
                                    "name": "c",
                                    "image": "example.invalid/x",
                                    "resources": {
                                        "requests": res,
                                        "limits": {"nvidia.com/gpu": str(gpus)},
                                    },
                                }
                            ],
                        },
                    },
                },
            },
        )

    def pods(self, selector: str = "") -> list[dict[str, Any]]:
        q = {"labelSelector": selector} if selector else None
        return list(
            self.cp.admin.request("GET", f"/api/v1/namespaces/{NS}/pods", query=q).get("items")
            or []
        )

    def events(self, pod_name: str) -> list[dict[str, Any]]:
        q = {"fieldSelector": f"involvedObject.name={pod_name}"}
        return list(
            self.cp.admin.request("GET", f"/api/v1/namespaces/{NS}/events", query=q).get("items")
            or []
        )

    def delete(self, path: str) -> None:
        with contextlib.suppress(KubeError):
            self.cp.admin.request("DELETE", path, body={"propagationPolicy": "Background"})


def metric(url: str, name: str, **labels: str) -> float:
    """One series of a rebalancer's /metrics (0 when absent)."""
    return scrape(url + "/metrics", name, **labels)


@contextlib.contextmanager
def running_rig(
    tools_bin: Path,
    controllers: str = CONTROLLERS,
    *,
    dra: bool = False,
    sched_conf: dict[str, Any] | None = None,
    default_scheduler: bool = False,
) -> Iterator[RebalanceRig]:
    """A control plane with kube-controller-manager (`controllers`), the extender
    (binpack; `dra`), gpudaemon-scheduler (`sched_conf`: its configuration, else the
    shipped one), optionally a plain default scheduler, and the kubelet stand-in."""
    cp = ControlPlane(tools_bin)
    r = RebalanceRig(cp)
    try:
        cp.start()
        cp.apply_manifest(RBAC)
        cp.apply_manifest(ADMISSION)
        r.start_controller_manager(controllers)
        r.start_extender(policy="binpack", dra=dra)
        r.start_scheduler("gpudaemon-scheduler", with_extender=True, conf=sched_conf)
        if default_scheduler:
            r.start_scheduler("default-scheduler", with_extender=False)
        r.kubelet.start()
        yield r
    finally:
        r.stop()
        cp.stop()
