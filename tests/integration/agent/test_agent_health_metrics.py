"""A real `gpudaemon run` with the health fault kinds of issue 30: the new series and
the verdict appear on its /metrics (scraped over HTTP), absent where a GPU gives none."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support import free_port, http_get, start_agent, stop, wait_for

pytestmark = pytest.mark.integration

PROFILE = """
gpus:
  - {name: NVIDIA H100 80GB HBM3, memory_total_mib: 81559, compute_capability: "9.0",
     count: 4, nvlink_links: 4}
  - {name: Tesla V100-SXM2-16GB, memory_total_mib: 16160, compute_capability: "7.0"}
faults:
  - {kind: row_remap, gpu: 0, pending: true, uncorrectable: 1}
  - {kind: recovery_action, gpu: 1, action: node_reboot}
  - {kind: nvlink_errors, gpu: 2, link: 3, crc_flit: 5}
  - {kind: clock_event, gpu: 3, reasons: [hw_slowdown]}
"""


def _value(body: bytes, name: str, gpu: int, **labels: str) -> float | None:
    for line in body.decode().splitlines():
        if not line.startswith(name + "{"):
            continue
        if f'gpu="{gpu}"' in line and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_a_running_agent_exports_the_health_series_and_verdicts(tmp_path: Path) -> None:
    profile = tmp_path / "p.yaml"
    profile.write_text(PROFILE)
    config = tmp_path / "c.yaml"
    config.write_text("schedules: {telemetry: '* * * * * *'}\n")
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
        log=tmp_path / "agent.log",
    )
    try:

        def body() -> bytes:
            return http_get(f"http://127.0.0.1:{port}/metrics")[1]

        wait_for(
            lambda: (
                (
                    _value(
                        body(), "gpudaemon_gpu_nvlink_errors_total", 2, link="3", type="crc_flit"
                    )
                    or 0
                )
                >= 10
            ),
            timeout=60,
            what="NVLink errors added on two polls",
        )
        b = body()
    finally:
        assert stop(proc) == 0
    state = "gpudaemon_gpu_health_state"
    action = "gpudaemon_gpu_health_action"
    assert _value(b, state, 0, state="unhealthy") == 1.0
    assert _value(b, action, 0, action="reset_gpu") == 1.0
    assert _value(b, "gpudaemon_gpu_row_remap_pending", 0) == 1.0
    assert _value(b, "gpudaemon_gpu_remapped_rows", 0, cause="uncorrectable") == 1.0
    assert _value(b, "gpudaemon_gpu_recovery_action", 1, action="node_reboot") == 1.0
    assert _value(b, "gpudaemon_gpu_recovery_action", 1, action="none") == 0.0
    assert _value(b, action, 1, action="reboot_node") == 1.0
    assert _value(b, state, 2, state="healthy") == 1.0  # a counter alone is not a verdict
    assert _value(b, "gpudaemon_gpu_clock_event_active", 3, reason="hw_slowdown") == 1.0
    assert _value(b, state, 3, state="degraded") == 1.0
    assert _value(b, "gpudaemon_gpu_healthy", 3) == 1.0  # degraded stays schedulable
    # The V100: no row remapping (absent, not 0), page retirement instead.
    assert _value(b, "gpudaemon_gpu_row_remap_pending", 4) is None
    assert _value(b, "gpudaemon_gpu_retired_pages_pending", 4) == 0.0
    assert re.search(rb"gpudaemon_gpu_clock_event_seconds_total\{", b)
