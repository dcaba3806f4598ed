"""API server down: the agent process keeps serving /metrics the whole time, does not
crash-loop, backs off instead of hammering, and after the restart its labels (and a GPU
lost during the outage) converge. The backoff cap and the connect timeout are injected
short, so the outage spans many caps in a few seconds; the exact timing of the backoff
(each delay, retry as soon as due) is pinned with a fake clock in tests/unit/test_kube.py."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.integration.kube.controlplane import ControlPlane, annotation
from tests.support import free_port, http_get, start_agent, stop, wait_for

pytestmark = pytest.mark.integration

P = "gpudaemon.io/"
BACKOFF_CAP_S = 2
OUTAGE_S = 15  # at least; it also lasts until GPU 2 has been lost
LOST_AT_S = 30  # after the agent's start: after its first labels, during the outage


def test_agent_survives_an_outage_backs_off_and_converges(
    control_plane: ControlPlane, node: str, tmp_path: Path
) -> None:
    port = free_port()
    profile = tmp_path / "profile.yaml"
    # GPU 2 is lost LOST_AT_S after start: that is during the outage.
    profile.write_text(
        'driver_version: "550.54.15"\ncuda_version: "12.4"\n'
        f"faults: [{{kind: lost, gpu: 2, after_s: {LOST_AT_S}}}]\n"
        "gpus:\n  - {name: NVIDIA H100 80GB HBM3, memory_total_mib: 81559,"
        ' compute_capability: "9.0", count: 4}\n'
    )
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(
        f"node_name: {node}\nsimulate: {profile}\n"
        f"metrics: {{listen: '127.0.0.1:{port}'}}\n"
        "labels: {to: apiserver}\n"
        'schedules: {telemetry: "* * * * * *", labels: "*/2 * * * * *",'
        ' inventory: "*/10 * * * * *"}\n'
        f"kubernetes: {{kubeconfig: '{control_plane.agent_kubeconfig}',"
        f" backoff_max_seconds: {BACKOFF_CAP_S}, request_timeout_seconds: 1,"
        " connect_timeout_seconds: 0.5,"
        " lease_duration_seconds: 12}\n"
    )
    log = tmp_path / "agent.log"
    started = time.monotonic()
    proc = start_agent(["run", "--config", str(cfg)], log=log)
    try:
        wait_for(
            lambda: control_plane.node(node)["metadata"]["labels"].get(P + "gpu.healthy") == "4",
            timeout=LOST_AT_S - 5,
            what="first labels",
        )
        wait_for(lambda: control_plane.lease(node), timeout=30, what="first lease")

        # From the first signal: kube-apiserver 1.37 drains for a while on SIGTERM, and
        # the agent's attempts during the drain count as much as those after it.
        down_at = time.monotonic()
        control_plane.stop_apiserver()
        answers = []
        while time.monotonic() - down_at < OUTAGE_S or time.monotonic() - started < LOST_AT_S + 3:
            status, body = http_get(f"http://127.0.0.1:{port}/metrics", timeout=5)
            answers.append(status)
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(1)  # sampled over the outage, which is the time under test
        assert answers and set(answers) == {200}, answers
        outage_s = time.monotonic() - down_at
        errors = _metric(body, 'gpudaemon_node_writes_total{result="error"}')
        assert errors >= 2, "the outage never reached the sink, or it never retried"
        # Backoff, not hammering: with delays of at least half the cap once it is
        # reached, the attempts are bounded (the doubling start adds a few).
        assert errors <= outage_s / (BACKOFF_CAP_S / 2) + 4, (errors, outage_s)
        job_errors = _metric(body, 'gpudaemon_poll_errors_total{task="kube-retry"}')
        assert job_errors >= 1, "kube-retry failures are counted like every job's"

        control_plane.start_apiserver()  # returns once /readyz answers
        wait_for(
            lambda: control_plane.node(node)["metadata"]["labels"].get(P + "gpu.healthy") == "3",
            timeout=BACKOFF_CAP_S + 30,  # a liveness bound, not the claim (see docstring)
            interval=0.25,
            what="labels after recovery",
        )
        gpus = {g["index"]: g for g in annotation(control_plane.node(node))}
        assert gpus[2]["healthy"] is False
        before = control_plane.lease(node)
        assert before is not None
        wait_for(
            lambda: (
                (control_plane.lease(node) or {})["spec"]["renewTime"] > before["spec"]["renewTime"]
            ),
            timeout=15,
            what="lease renewed after recovery",
        )
        assert proc.poll() is None
        text = log.read_text()
        assert "Traceback" not in text
    finally:
        if control_plane.apiserver is None:
            control_plane.start_apiserver()
        assert stop(proc) == 0, log.read_text()[-3000:]


def _metric(body: bytes, series: str) -> float:
    for line in body.decode().splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{series} not in /metrics")
