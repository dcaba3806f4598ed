"""A real `gpudaemon run` process with simulated faults logs one ERROR line per faulty
GPU, however many polls the fault lasts (issue 12 item 14; docs/operations.md). Here,
not in tests/unit: it runs the agent for about ten real seconds."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support import free_port, http_get, start_agent, stop, wait_for
from tests.unit.test_healthlog import PROFILE

pytestmark = pytest.mark.integration


def test_a_running_agent_logs_each_simulated_fault_once(tmp_path: Path) -> None:
    """End to end: `gpudaemon run` polling every second for many polls after the faults
    fire writes one ERROR line per faulty GPU, and nothing per poll."""
    profile = tmp_path / "faulty.yaml"
    profile.write_text(
        PROFILE + "\nfaults: [{kind: lost, gpu: 1, after_polls: 1},"
        " {kind: xid, gpu: 2, xid: 79, after_polls: 1},"
        " {kind: ecc, gpu: 3, uncorrected: 1, after_polls: 1}]\n"
    )
    config = tmp_path / "c.yaml"
    config.write_text("schedules: {telemetry: '* * * * * *'}\n")
    log = tmp_path / "agent.log"
    port = free_port()
    proc = start_agent(
        [
            "run",
            "--config",
            str(config),
            "--simulate",
            str(profile),
            "--labels-to",
            "none",
            "--listen",
            f"127.0.0.1:{port}",
        ],
        log=log,
    )
    try:

        def polls() -> float:
            _, body = http_get(f"http://127.0.0.1:{port}/metrics")
            m = re.search(
                rb'gpudaemon_poll_duration_seconds_count\{[^}]*"telemetry"[^}]*\} (\S+)', body
            )
            return float(m.group(1)) if m else 0.0

        wait_for(lambda: polls() >= 8, timeout=60, what="eight telemetry polls")
    finally:
        assert stop(proc) == 0
    text = log.read_text()
    errors = [line for line in text.splitlines() if " ERROR " in line]
    assert len(errors) == 3, text
    for gpu, reason in [(1, "gpu lost"), (2, "xid 79"), (3, "ecc uncorrected errors")]:
        assert sum(f"GPU {gpu} (GPU-" in e and e.endswith(reason) for e in errors) == 1, errors
