"""The extender container OOM-killed at 3 a.m.: on a real etcd, kube-apiserver and
kube-scheduler with the chart's scheduler configuration, `gpudaemon extender` as a real
process is killed with SIGKILL and started again with the same configuration.

While it is away, GPU pods wait Pending (the chart's extender is not ignorable): none is
bound past it. Started again, it answers /readyz within a bound, /filter says 503 until
then, the waiting pods bind, and the new process's view of each node counts the pods
bound before the kill: it books nothing twice.
"""

from __future__ import annotations

import functools
import http.client
import json
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.kube.controlplane import ADMISSION, RBAC, ControlPlane
from tests.integration.scheduler.rig import SCHED_CONFIG, SchedulerRig
from tests.support import ProcessExited, free_port, http_get, scrape, start_agent, wait_for

pytestmark = pytest.mark.integration

SCHED = "gpudaemon-scheduler"
READY_WITHIN_S = 30.0  # generous: a loaded 2-core CI machine, an interpreter to start
HOST = "kubernetes.io/hostname"


class ExtenderProcess:
    """`gpudaemon extender` as the chart runs it, startable again on the same config
    (so the same ports) after it died."""

    def __init__(self, rig: SchedulerRig, name: str) -> None:
        self.rig = rig
        self.port, self.metrics_port = free_port(), free_port()
        self.cfg = rig.dir / f"{name}.yaml"
        self.cfg.write_text(yaml.safe_dump({
            "extender": {
                "listen": f"127.0.0.1:{self.port}",
                "metrics_listen": f"127.0.0.1:{self.metrics_port}",
                "policy": "binpack",
                "scheduler_name": SCHED,
            },
            "kubernetes": {"kubeconfig": str(rig.cp.admin_kubeconfig),
                           "lease_namespace": "gpudaemon"},
        }))  # fmt: skip
        self.name = name
        self.starts = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.rig.dir / f"{self.name}-{self.starts}.log"

    def start(self) -> subprocess.Popen[bytes]:
        self.starts += 1
        self.proc = start_agent(["extender", "--config", str(self.cfg)], log=self.log)
        self.rig.procs.append(self.proc)
        return self.proc

    def alive(self) -> None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise ProcessExited(self.log.read_text(errors="replace")[-3000:])

    def readyz(self) -> int:
        self.alive()
        return http_get(f"http://127.0.0.1:{self.metrics_port}/readyz", timeout=2)[0]

    def metric(self, name: str, **labels: str) -> float:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        return scrape(url, name, required=False, **labels)

    def allocated(self, nodes: list[str]) -> dict[str, float]:
        """GPUs requested by bound pods on each node, as this process counts them."""
        return {n: self.metric("gpudaemon_extender_node_gpus", node=n, kind="allocated")
                for n in nodes}  # fmt: skip

    def filter(self, gpus: int, nodes: list[str]) -> tuple[int, dict[str, Any]]:
        """/filter for a pod the extender cannot book (no UID): its view, no side effect."""
        body = json.dumps({
            "Pod": {"metadata": {"name": "probe", "namespace": "default", "uid": ""},
                    "spec": {"schedulerName": SCHED, "containers": [
                        {"name": "c", "resources": {"requests": {"nvidia.com/gpu": str(gpus)}}}]}},
            "NodeNames": nodes,
        }).encode()  # fmt: skip
        req = urllib.request.Request(
            f"{self.url}/filter",
            data=body,
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")


@pytest.fixture(scope="module")
def restart_rig(tools_bin: Path) -> Iterator[tuple[SchedulerRig, ExtenderProcess]]:
    cp = ControlPlane(tools_bin)
    rig = SchedulerRig(cp)
    try:
        cp.start()
        cp.apply_manifest(RBAC)
        cp.apply_manifest(ADMISSION)
        ext = ExtenderProcess(rig, "extender")
        ext.start()
        wait_for(lambda: ext.readyz() == 200, timeout=60, what="extender /readyz")
        rig.start_scheduler(SCHED, True, url=ext.url)
        yield rig, ext
    finally:
        rig.stop()
        cp.stop()


def scheduling_failed(rig: SchedulerRig, pod: str) -> str:
    """The message of the pod's PodScheduled=False condition ("" while none)."""
    for c in rig.pod(pod).get("status", {}).get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False":
            return str(c.get("message") or c.get("reason") or "?")
    return ""


def test_a_killed_extender_holds_gpu_pods_and_its_restart_books_nothing_twice(
    restart_rig: tuple[SchedulerRig, ExtenderProcess],
) -> None:
    rig, ext = restart_rig
    # What the test relies on: the chart's extender may not be skipped.
    assert yaml.safe_load(SCHED_CONFIG.read_text())["extenders"][0]["ignorable"] is False

    group = uuid.uuid4().hex[:6]
    a, b, c = nodes = [f"{group}-{i}" for i in "abc"]
    for n in nodes:
        rig.add_node(n, group)
    rig.run_agents(nodes)
    wait_for(
        lambda: all(ext.metric("gpudaemon_extender_node_fresh", node=n) == 1 for n in nodes),
        timeout=30,
        what="the extender to see the agents' data, fresh",
    )

    # Partly full before the kill, through the extender: 2, 4 and 6 of 8 GPUs taken.
    before = {a: 2, b: 4, c: 6}
    for node, gpus in before.items():
        pod = rig.create_pod(gpus, group, selector={HOST: node})
        assert rig.wait_bound(pod, timeout=60) == node
    assert rig.gpus_by_node(nodes) == before

    assert ext.proc is not None
    ext.proc.kill()  # the OOM killer's SIGKILL: no shutdown code runs
    ext.proc.wait(10)

    # What is left fits only one way: 2 on c, 4 on b, 6 on a. Smallest first (the
    # scheduler retries them in that order): a view without the pods above sees 8 free
    # everywhere, breaks the tie by node name and packs the 2 and then the 4 on a,
    # where only the 6 fitted, which then fits nowhere.
    waiting = [rig.create_pod(g, group) for g in (2, 4, 6)]
    for p in waiting:
        why = wait_for(
            functools.partial(scheduling_failed, rig, p),
            timeout=60,
            what=f"kube-scheduler to try {p} without the extender",
        )
        assert "/filter" in why, why  # held by the extender's absence, nothing else
        assert not rig.pod(p)["spec"].get("nodeName"), f"{p} bound past a dead extender"
    print(f"\nwhile the extender is down, the pods wait: {why}")
    held = rig.requests_by_node(nodes, "nvidia.com/gpu")
    assert held == before, f"a pod bound while the extender was down: {held}"

    # Started again on the same config: ready within a bound, 503 to /filter until then.
    t0 = time.monotonic()
    ext.start()
    early: list[int] = []  # /filter's answers seen before /readyz said 200

    def ready() -> bool:
        try:
            code, _ = ext.filter(1, nodes)  # first: readiness, once reached, stays
        except (OSError, http.client.HTTPException):
            code = 0  # not listening yet
        if ext.readyz() == 200:
            return True
        if code:
            early.append(code)
        return False

    wait_for(ready, timeout=60, interval=0.02, what="the restarted extender's /readyz")
    took = time.monotonic() - t0
    print(f"restarted extender ready after {took:.2f}s; /filter before that: {early}")
    assert took < READY_WITHIN_S
    assert set(early) <= {503}, f"/filter answered {early} before the extender was ready"
    # Ready means listed: the pods bound before the kill are counted already.
    seen = ext.allocated(nodes)
    assert all(seen[n] >= before[n] for n in nodes), f"restarted extender sees {seen}"

    # The waiting pods bind, each where it fits beside the pods bound before the kill.
    placed = {p: rig.wait_bound(p, timeout=90) for p in waiting}
    print(f"waiting pods bound {time.monotonic() - t0 - took:.2f}s after it was ready")
    assert placed == dict(zip(waiting, [c, b, a], strict=True)), placed
    after = rig.requests_by_node(nodes, "nvidia.com/gpu")
    assert after == {n: 8 for n in nodes}, after  # 8 allocatable each: none over

    # The new process's own view counts the pods bound before it started: every node
    # full, so a 1-GPU pod fits nowhere (it would pass everywhere on a forgetful view).
    wait_for(
        lambda: ext.allocated(nodes) == {n: 8 for n in nodes},
        timeout=30,
        what="the restarted extender to count every bound pod",
    )
    code, answer = ext.filter(1, nodes)
    assert code == 200, answer
    assert answer["NodeNames"] == [], answer
    assert all("needs 1 GPU(s), 0 healthy free" in answer["FailedNodes"][n] for n in nodes), answer
    rig.delete_pods(waiting)
