"""The simulator's health fault kinds, end to end through `gpudaemon probe`: each shows
its state and action per GPU, in the `gpus` annotation and in `gpu.unhealthy`; a bad
field is one line at load (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpudaemon.backends.simulated import SimulatedBackend, parse_profile
from gpudaemon.errors import ProfileError
from gpudaemon.labels.annotations import decode_gpus
from tests.support import run_cli

H100 = """
gpus:
  - name: NVIDIA H100 80GB HBM3
    memory_total_mib: 81559
    compute_capability: "9.0"
    count: {count}
    nvlink_links: 18
faults:
{faults}
"""


def _profile(tmp_path: Path, faults: list[str], count: int = 1) -> str:
    p = tmp_path / "p.yaml"
    p.write_text(H100.format(count=count, faults="\n".join(f"  - {f}" for f in faults)))
    return str(p)


@pytest.mark.parametrize(
    ("fault", "state", "action"),
    [
        ("{kind: row_remap, gpu: 0, pending: true}", "unhealthy", "reset_gpu"),
        ("{kind: row_remap, gpu: 0, failure: true}", "unhealthy", "replace"),
        ("{kind: row_remap, gpu: 0, correctable: 3}", "healthy", "none"),
        ("{kind: recovery_action, gpu: 0, action: gpu_reset}", "unhealthy", "reset_gpu"),
        ("{kind: recovery_action, gpu: 0, action: node_reboot}", "unhealthy", "reboot_node"),
        ("{kind: recovery_action, gpu: 0, action: drain_p2p}", "unhealthy", "drain"),
        ("{kind: recovery_action, gpu: 0, action: drain_and_reset}", "unhealthy", "reset_gpu"),
        ("{kind: recovery_action, gpu: 0, action: none}", "healthy", "none"),
        ("{kind: clock_event, gpu: 0, reasons: [hw_slowdown]}", "degraded", "watch"),
        ("{kind: clock_event, gpu: 0, reasons: [hw_thermal, sw_thermal]}", "degraded", "watch"),
        ("{kind: clock_event, gpu: 0, reasons: [hw_power_brake]}", "degraded", "watch"),
        ("{kind: xid, gpu: 0, xid: 95}", "unhealthy", "reboot_node"),
    ],
)
def test_probe_shows_each_fault_kinds_state_and_action(
    tmp_path: Path, fault: str, state: str, action: str
) -> None:
    proc = run_cli("probe", "--simulate", _profile(tmp_path, [fault], 2), "--format", "json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    sick, fine = out["gpus"]
    assert (sick["health"]["state"], sick["health"]["action"]) == (state, action)
    assert fine["health"] == {"state": "healthy", "action": "none"}
    (annotation,) = out["annotations"].values()
    gpus = decode_gpus(annotation)
    assert (gpus[0].state, gpus[0].action) == (state, action)
    assert gpus[0].healthy == (state != "unhealthy")
    labels = {k.rsplit("/", 1)[1]: v for k, v in out["labels"].items()}
    assert labels["gpu.unhealthy"] == ("1" if state == "unhealthy" else "0")
    assert labels["gpu.healthy"] == ("1" if state == "unhealthy" else "2")
    assert not any("degraded" in k or "degraded" in v for k, v in out["labels"].items())


def test_a_clock_slowdown_alone_leaves_the_gpu_schedulable(tmp_path: Path) -> None:
    f = "{kind: clock_event, gpu: 0, reasons: [hw_slowdown]}"
    out = json.loads(
        run_cli("probe", "--simulate", _profile(tmp_path, [f]), "--format", "json").stdout
    )
    (gpu,) = out["gpus"]
    assert gpu["health"] == {
        "state": "degraded",
        "action": "watch",
        "reason": "clock event hw_slowdown",
    }
    assert gpu["reading"]["healthy"] is True
    assert {k.rsplit("/", 1)[1]: v for k, v in out["labels"].items()}["gpu.unhealthy"] == "0"


def test_nvlink_errors_are_added_on_every_poll_from_the_fault_on() -> None:
    prof = parse_profile(
        H100.format(
            count=1,
            faults="  - {kind: nvlink_errors, gpu: 0, link: 5, crc_flit: 10, "
            "replay: 1, after_polls: 1}",
        )
    )
    b = SimulatedBackend(prof)
    counts = [b.sample()[0].nvlink_errors_total[5] for _ in range(3)]
    assert [c["crc_flit"] for c in counts] == [0, 10, 20]
    assert [c["replay"] for c in counts] == [0, 1, 2] and counts[2]["crc_data"] == 0


def test_a_row_remap_fault_then_its_clearing_fault() -> None:
    prof = parse_profile(
        H100.format(
            count=1,
            faults="  - {kind: row_remap, gpu: 0, pending: true, uncorrectable: 1}\n"
            "  - {kind: row_remap, gpu: 0, pending: false, after_polls: 1}",
        )
    )
    b = SimulatedBackend(prof)
    first, second = b.sample()[0], b.sample()[0]
    assert first.health_action == "reset_gpu" and first.remapped_rows_uncorrectable == 1
    assert second.health_state == "healthy" and second.remapped_rows_uncorrectable == 1


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ("{kind: row_remap, gpu: 0}", "kind row_remap needs one of pending"),
        ("{kind: row_remap, gpu: 0, pending: 1}", "pending: Input should be a valid boolean"),
        ("{kind: row_remap, gpu: 0, action: gpu_reset}", "action: not used by kind row_remap"),
        ("{kind: recovery_action, gpu: 0}", "kind recovery_action needs action"),
        ("{kind: recovery_action, gpu: 0, action: reboot}", "action: Input should be"),
        ("{kind: nvlink_errors, gpu: 0, link: 2}", "needs crc_flit, crc_data, replay or"),
        ("{kind: nvlink_errors, gpu: 0, link: 18, replay: 1}", "needs nvlink_links above 18"),
        ("{kind: nvlink_errors, gpu: 0, crc_flit: -1}", "crc_flit: Input should be greater"),
        ("{kind: clock_event, gpu: 0}", "kind clock_event needs reasons"),
        ("{kind: clock_event, gpu: 0, reasons: [slow]}", "reasons.0: Input should be"),
        ("{kind: clock_event, gpu: 0, reasons: [hw_slowdown], link: 1}", "link: not used"),
    ],
)
def test_a_bad_field_is_one_line_at_load(tmp_path: Path, fault: str, message: str) -> None:
    path = _profile(tmp_path, [fault])
    with pytest.raises(ProfileError, match=message.replace("(", r"\(")) as e:
        parse_profile(Path(path).read_text(), path)
    assert "\n" not in str(e.value)
    proc = run_cli("probe", "--simulate", path)
    assert proc.returncode == 2 and message.split(":")[0] in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_a_row_remap_needs_an_ampere_gpu_with_ecc() -> None:
    with pytest.raises(ProfileError, match=r"compute_capability 8\.0 or later"):
        parse_profile(
            "gpus: [{name: V100, memory_total_mib: 16384, compute_capability: '7.0'}]\n"
            "faults: [{kind: row_remap, gpu: 0, pending: true}]"
        )
