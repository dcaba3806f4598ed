"""A real Prometheus (Debian's package) scraping two real `gpudaemon run` agents.

Node A simulates a DGX H100 with faults from a profile file (XID 79 on GPU 3, GPU 5
lost) and a fake kubelet assigning GPU 2 to a pod; node B simulates A100s split into
MIG instances, one of them assigned to a pod. Prometheus scrapes both every second
and evaluates the shipped alert rules every second, with `for:` durations shortened
(only those) so alerts fire within the test.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpudaemon.backends.simulated import SimulatedBackend, load_profile
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


@pytest.fixture(scope="session")
def stack() -> Iterator[Stack]:
    prometheus = need("prometheus")
    work = Path(tempfile.mkdtemp(prefix="gpud-prom-"))
    procs: list[subprocess.Popen[bytes]] = []
    kubelets: list[KubeletServer] = []
    try:
        # Node A: faults from a profile file, the way an operator would write them.
        profile = yaml.safe_load((REPO / "gpudaemon/backends/profiles/dgx-h100.yaml").read_text())
        profile["faults"] = [
            {"kind": "xid", "gpu": 3, "xid": 79, "after_s": 3},
            {"kind": "lost", "gpu": 5, "after_s": 3},
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
            kl = KubeletServer(work / f"{node}.sock")
            kl.servicer.pods = [pod(f"job-{node}", "ml", ("main", {res: [dev]}))]
            kubelets.append(kl)
            cfg = work / f"{node}.yaml"
            cfg.write_text(
                yaml.safe_dump(
                    {
                        "schedules": {"telemetry": "* * * * * *", "pods": "*/2 * * * * *"},
                        "metrics": {"pod_resources_socket": str(kl.socket)},
                    }
                )
            )
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
                        str(work / f"{node}-labels.json"),
                    ],
                    log=work / f"{node}.log",
                )
            )
            agents[node] = Agent(node, prof, f"http://127.0.0.1:{port}")
        for a in agents.values():
            wait_for(lambda a=a: http_get(a.url + "/readyz")[0] == 200, 20, what=f"{a.node} ready")

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
                        }
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
        s = Stack(agents, prom_url, gpu2_uuid, mig_uuid, work)
        wait_for(lambda: len(s.query('up{job="gpudaemon"} == 1')) == 2, 30, what="both targets up")
        yield s
    finally:
        for p in reversed(procs):
            stop(p)
        for kl in kubelets:
            kl.stop()
        shutil.rmtree(work, ignore_errors=True)
