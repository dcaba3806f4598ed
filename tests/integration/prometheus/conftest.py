"""A real Prometheus (Debian's package) scraping two real `gpudaemon run` agents and a
real `gpudaemon extender` and a real `gpudaemon rebalance` (dry run), all on a real
kube-apiserver.

Node A simulates a DGX H100 with faults from a profile file (XID 79 on GPU 3, GPU 5
lost, a pending row remap on GPU 6, a clock slowdown on GPU 1) and a fake kubelet assigning GPU 2 to a pod, and writes history to an InfluxDB
that does not answer (so the history series have something to say); node B simulates
A100s split into MIG instances, one of them assigned to a pod. Both label their Nodes
and hold Leases, which the extender watches; a few /filter and /prioritize calls give
its latency series data. Prometheus scrapes every second and evaluates the shipped
alert rules every second, with `for:` durations shortened (only those) so alerts fire
within the test.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpudaemon.backends.simulated import SimulatedBackend, load_profile
from tests.integration.kube.conftest import control_plane as control_plane
from tests.integration.kube.controlplane import ControlPlane
from tests.integration.podresources.fake_kubelet import KubeletServer, pod
from tests.support import REPO, free_port, http_get, start_agent, stop, wait_for

RULES = REPO / "deploy" / "prometheus" / "gpudaemon-rules.yaml"
NODE_A, NODE_B = "gpu-node-a", "gpu-node-b"


def need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.fail(f"{tool} not found: apt-get install -y prometheus (see docs/testing.md)")
    return path


@pytest.fixture(scope="session")
def promtool() -> str:
    return need("promtool")


@dataclass
class Agent:
    node: str
    profile: str
    url: str


@dataclass
class Stack:
    agents: dict[str, Agent]
    prom_url: str
    extender_url: str
    gpu2_uuid: str
    mig_uuid: str
    workdir: Path

    def query(self, expr: str) -> list[dict[str, Any]]:
        q = urllib.parse.urlencode({"query": expr})
        status, body = http_get(f"{self.prom_url}/api/v1/query?{q}")
        data = json.loads(body)
        assert status == 200 and data["status"] == "success", (expr, data)
        return list(data["data"]["result"])

    def alerts(self) -> list[dict[str, Any]]:
        status, body = http_get(f"{self.prom_url}/api/v1/alerts")
        assert status == 200
        return list(json.loads(body)["data"]["alerts"])


def _shorten_for(rules_text: str) -> str:
    return re.sub(r"^(\s+for:\s*)\S+", r"\g<1>2s", rules_text, flags=re.M)


def _ask_extender(url: str) -> None:
    """What kube-scheduler sends for a pod of another scheduler: answered, not booked."""
    args = {
        "Pod": {
            "metadata": {"uid": "00000000-0000-0000-0000-000000000001", "name": "probe",
                         "namespace": "default"},
            "spec": {"containers": [{"name": "c",
                                     "resources": {"limits": {"nvidia.com/gpu": "1"}}}]},
        },
        "NodeNames": [NODE_A, NODE_B],
    }  # fmt: skip
    for verb in ("filter", "prioritize"):
        req = urllib.request.Request(
            f"{url}/{verb}", data=json.dumps(args).encode(), method="POST",
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 200


@pytest.fixture(scope="session")
def stack(control_plane: ControlPlane) -> Iterator[Stack]:
    cp = control_plane
    prometheus = need("prometheus")
    work = Path(tempfile.mkdtemp(prefix="gpud-prom-"))
    procs: list[subprocess.Popen[bytes]] = []
    kubelets: list[KubeletServer] = []
    try:
        # Node A: faults from a profile file, the way an operator would write them.
        profile = yaml.safe_load((REPO / "gpudaemon/backends/profiles/dgx-h100.yaml").read_text())
        # GPU 2 (the one a pod holds) sits idle: "idle but allocated" (issue 33's GPM).
        h100 = profile["gpus"][0]
        idle = {**h100, "count": 1, "utilization": {"pattern": "idle"}}
        profile["gpus"] = [{**h100, "count": 2}, idle, {**h100, "count": 5}]
        profile["faults"] = [
            {"kind": "xid", "gpu": 3, "xid": 79, "after_s": 3},
            {"kind": "lost", "gpu": 5, "after_s": 3},
            # Issue 30's health signals: a reset needed, and a degraded GPU.
            {"kind": "row_remap", "gpu": 6, "pending": True, "after_s": 3},
            {"kind": "clock_event", "gpu": 1, "reasons": ["hw_slowdown"], "after_s": 3},
        ]
        (work / "dgx-faulty.yaml").write_text(yaml.safe_dump(profile))
        gpu2 = SimulatedBackend(load_profile(str(work / "dgx-faulty.yaml")), seed=0)
        gpu2_uuid = gpu2.inventory().gpus[2].uuid
        mig_uuid = (
            SimulatedBackend(load_profile("a100-mig"), seed=0)
            .inventory()
            .gpus[4]
            .mig_devices[1]
            .uuid
        )

        agents: dict[str, Agent] = {}
        for node, prof, res, dev in (
            (NODE_A, str(work / "dgx-faulty.yaml"), "nvidia.com/gpu", gpu2_uuid),
            (NODE_B, "a100-mig", "nvidia.com/mig-1g.10gb", mig_uuid),
        ):
            cp.create_node(node, {})
            kl = KubeletServer(work / f"{node}.sock")
            kl.servicer.pods = [pod(f"job-{node}", "ml", ("main", {res: [dev]}))]
            kubelets.append(kl)
            cfg = work / f"{node}.yaml"
            conf: dict[str, Any] = {
                "schedules": {
                    "telemetry": "* * * * * *",
                    "pods": "*/2 * * * * *",
                    "labels": "*/2 * * * * *",
                    "history": "* * * * * *",
                },
                "metrics": {"pod_resources_socket": str(kl.socket)},
                "kubernetes": {"kubeconfig": str(cp.agent_kubeconfig)},
            }
            if node == NODE_A:  # an InfluxDB that refuses: spool, errors, oldest point
                conf["influxdb"] = {
                    "url": f"http://127.0.0.1:{free_port()}",
                    "bucket": "gpus",
                    "spool_dir": str(work / "spool"),
                    "timeout_ms": 500,
                }
            cfg.write_text(yaml.safe_dump(conf))
            port = free_port()
            procs.append(
                start_agent(
                    [
                        "run",
                        "--config",
                        str(cfg),
                        "--simulate",
                        prof,
                        "--seed",
                        "0",
                        "--node-name",
                        node,
                        "--listen",
                        f"127.0.0.1:{port}",
                        "--labels-to",
                        "apiserver",
                    ],
                    log=work / f"{node}.log",
                )
            )
            agents[node] = Agent(node, prof, f"http://127.0.0.1:{port}")
        for a in agents.values():
            wait_for(lambda a=a: http_get(a.url + "/readyz")[0] == 200, 20, what=f"{a.node} ready")
            wait_for(lambda a=a: cp.lease(a.node), 60, what=f"{a.node}'s Lease")

        eport, emetrics = free_port(), free_port()
        (work / "extender.yaml").write_text(
            yaml.safe_dump(
                {
                    "extender": {
                        "listen": f"127.0.0.1:{eport}",
                        "metrics_listen": f"127.0.0.1:{emetrics}",
                    },
                    "kubernetes": {"kubeconfig": str(cp.admin_kubeconfig)},
                }
            )
        )
        procs.append(
            start_agent(["extender", "--config", str(work / "extender.yaml")],
                        log=work / "extender.log")
        )  # fmt: skip
        extender_metrics = f"127.0.0.1:{emetrics}"
        wait_for(
            lambda: http_get(f"http://{extender_metrics}/readyz")[0] == 200, 60,
            what="extender ready",
        )  # fmt: skip
        _ask_extender(f"http://127.0.0.1:{eport}")

        # The rebalancer (dry run): leads alone, sees node A's sick GPU 3.
        rmetrics = f"127.0.0.1:{free_port()}"
        (work / "rebalancer.yaml").write_text(
            yaml.safe_dump({"kubernetes": {"kubeconfig": str(cp.admin_kubeconfig)}})
        )
        procs.append(
            start_agent(["rebalance", "--config", str(work / "rebalancer.yaml"), "--listen",
                         rmetrics, "--identity", "rebalancer-0"], log=work / "rebalancer.log")
        )  # fmt: skip
        wait_for(
            lambda: http_get(f"http://{rmetrics}/readyz")[0] == 200, 60, what="rebalancer ready"
        )

        (work / "rules.yaml").write_text(_shorten_for(RULES.read_text()))
        pport = free_port()
        (work / "prometheus.yml").write_text(
            yaml.safe_dump(
                {
                    "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                    "rule_files": [str(work / "rules.yaml")],
                    "scrape_configs": [
                        {
                            "job_name": "gpudaemon",
                            "static_configs": [
                                {
                                    "targets": [
                                        a.url.removeprefix("http://") for a in agents.values()
                                    ]
                                }
                            ],
                        },
                        {  # the PodMonitor's job name: <namespace>/<release>-gpudaemon-extender
                            "job_name": "gpudaemon/gpudaemon-extender",
                            "static_configs": [{"targets": [extender_metrics]}],
                        },
                        {
                            "job_name": "gpudaemon/gpudaemon-rebalancer",
                            "static_configs": [{"targets": [rmetrics]}],
                        },
                    ],
                }
            )
        )
        plog = open(work / "prometheus.log", "wb")  # noqa: SIM115 - closed with the process
        procs.append(
            subprocess.Popen(
                [
                    prometheus,
                    f"--config.file={work / 'prometheus.yml'}",
                    f"--storage.tsdb.path={work / 'data'}",
                    f"--web.listen-address=127.0.0.1:{pport}",
                    "--web.enable-lifecycle",
                ],
                stdout=plog,
                stderr=subprocess.STDOUT,
                cwd=work,
            )
        )
        prom_url = f"http://127.0.0.1:{pport}"
        wait_for(lambda: http_get(prom_url + "/-/ready")[0] == 200, 30, what="prometheus ready")
        s = Stack(agents, prom_url, f"http://127.0.0.1:{eport}", gpu2_uuid, mig_uuid, work)
        wait_for(lambda: len(s.query('up{job="gpudaemon"} == 1')) == 2, 30, what="both targets up")
        wait_for(lambda: s.query('up{job=~".*extender.*"} == 1'), 30, what="the extender up")
        wait_for(lambda: s.query("gpudaemon_rebalancer_leader == 1"), 30, what="a leader")
        yield s
    finally:
        for p in reversed(procs):
            stop(p)
        for kl in kubelets:
            kl.stop()
        shutil.rmtree(work, ignore_errors=True)
