"""A real `gpudaemon run` process serves /readyz, /metrics and its labels, runs its
scheduled jobs, and stops cleanly on SIGTERM within its grace period."""

import json
import signal
from pathlib import Path

import pytest

from tests.support import free_port, http_get, start_agent, stop, wait_for

pytestmark = pytest.mark.integration


def test_sigterm_stops_a_running_agent_promptly(tmp_path: Path) -> None:
    port = free_port()
    cfg = tmp_path / "c.yaml"
    cfg.write_text("schedules: {telemetry: '* * * * * *', labels: '* * * * * *'}\n")
    out = tmp_path / "labels.json"
    proc = start_agent(
        [
            "run",
            "--simulate",
            "dgx-h100",
            "--config",
            str(cfg),
            "--listen",
            f"127.0.0.1:{port}",
            "--labels-to",
            str(out),
        ],
        log=tmp_path / "log",
    )
    try:
        wait_for(lambda: http_get(f"http://127.0.0.1:{port}/readyz")[0] == 200, 20, what="/readyz")
        status, body = http_get(f"http://127.0.0.1:{port}/metrics")
        assert status == 200 and b"gpudaemon_gpu_temperature_celsius" in body
        assert http_get(f"http://127.0.0.1:{port}/healthz")[0] == 200
        assert json.loads(out.read_text())["labels"]["gpudaemon.io/gpu.count"] == "8"
        wait_for(lambda: _telemetry_runs(port) >= 2, 20, what="a scheduled telemetry run")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0  # the grace period, not a timing claim
    finally:
        stop(proc)
    log = (tmp_path / "log").read_text()
    assert "stopping" in log and "Traceback" not in log


def _telemetry_runs(port: int) -> float:
    body = http_get(f"http://127.0.0.1:{port}/metrics")[1].decode()
    key = 'gpudaemon_poll_duration_seconds_count{task="telemetry"} '
    return next((float(ln.split()[-1]) for ln in body.splitlines() if ln.startswith(key)), 0.0)
