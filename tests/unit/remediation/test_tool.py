"""The reset tool as nvidia-smi(1) documents it: exit statuses and messages from a fake
`nvidia-smi` (the real reset is never run here, nor on a lent GPU); the maintenance
window; the grant's codec against hostile values; which GPUs may be reset alone."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from gpudaemon.errors import BadValueError
from gpudaemon.model import GpuInfo
from gpudaemon.remediation import grant as grants
from gpudaemon.remediation.nvsmi import can_reset_alone, reset
from gpudaemon.remediation.window import open_at

UUID = "GPU-3f1c2a9e-0000-4000-8000-000000000002"


def fake_tool(tmp_path: Path, body: str) -> str:
    """A stand-in nvidia-smi: a shell script that checks its arguments as the real one
    takes them and answers with `body`."""
    path = tmp_path / "nvidia-smi"
    path.write_text(
        "#!/bin/sh\n"
        f'[ "$1" = "--gpu-reset" ] && [ "$2" = "-i" ] && [ "$3" = "{UUID}" ] || '
        "{ echo \"Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.\"; exit 2; }\n"
        + body
    )
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_a_good_reset_is_ok_with_the_tools_words(tmp_path: Path) -> None:
    tool = fake_tool(tmp_path, 'echo "GPU 00000000:18:00.0 was successfully reset."\nexit 0\n')
    r = reset(tool, UUID, 10)
    assert (r.ok, r.busy, r.code) == (True, False, 0)
    assert r.message == "GPU 00000000:18:00.0 was successfully reset."


def test_a_gpu_in_use_is_a_refusal_not_a_failure(tmp_path: Path) -> None:
    tool = fake_tool(tmp_path, (
        'echo "Unable to reset GPU 00000000:18:00.0 because it\'s being used by some other '
        'process (e.g. CUDA application, graphics application like X server, monitoring '
        'application like other instance of nvidia-smi). Please first kill all processes '
        'using this GPU and all compute applications running in the system." >&2\nexit 255\n'
    ))  # fmt: skip
    r = reset(tool, UUID, 10)
    assert (r.ok, r.busy, r.code) == (False, True, 255)
    assert r.message.startswith("exit 255 (other error or internal driver error): Unable to reset")


@pytest.mark.parametrize(
    ("code", "meaning"),
    [
        (3, "not available on the target device"),
        (4, "may not access this device"),
        (9, "driver is not loaded"),
        (15, "fallen off the bus"),
        (42, "does not document"),
    ],
)
def test_each_documented_exit_status_is_named(tmp_path: Path, code: int, meaning: str) -> None:
    r = reset(fake_tool(tmp_path, f"exit {code}\n"), UUID, 10)
    assert not r.ok and not r.busy and r.code == code and meaning in r.message


def test_a_hung_tool_is_killed_at_the_timeout(tmp_path: Path) -> None:
    r = reset(fake_tool(tmp_path, "exec sleep 30\n"), UUID, 0.5)
    assert (r.ok, r.code) == (False, None) and "did not finish in" in r.message


def test_a_missing_or_unusable_tool_is_one_clear_line(tmp_path: Path) -> None:
    r = reset(str(tmp_path / "nope"), UUID, 5)
    assert not r.ok and "not found (remediation.nvidia_smi)" in r.message
    plain = tmp_path / "plain"
    plain.write_text("#!/bin/sh\nexit 0\n")
    os.chmod(plain, 0o644)
    r = reset(str(plain), UUID, 5)
    assert not r.ok and "not executable" in r.message


def info(cc: tuple[int, int], links: int | None) -> GpuInfo:
    return GpuInfo(index=0, uuid=UUID, name="x", memory_total_bytes=1, compute_capability=cc,
                   nvlink_links=links)  # fmt: skip


def test_which_gpus_reset_alone() -> None:
    assert can_reset_alone(info((9, 0), 18))  # H100 SXM: Hopper resets alone
    assert can_reset_alone(info((8, 0), 12))  # A100 SXM: with Fabric Manager (the tool checks)
    assert can_reset_alone(info((7, 5), None))  # T4: PCIe, no NVLink
    assert not can_reset_alone(info((7, 0), 6))  # V100 SXM2: with its NVLink peers only


@pytest.mark.parametrize(
    ("window", "hhmm", "ok"),
    [
        ("", "12:00", True),
        ("01:00-05:00", "01:00", True),
        ("01:00-05:00", "04:59", True),
        ("01:00-05:00", "05:00", False),
        ("22:00-06:00", "23:30", True),
        ("22:00-06:00", "03:00", True),
        ("22:00-06:00", "12:00", False),
    ],
)
def test_the_maintenance_window(window: str, hhmm: str, ok: bool) -> None:
    t = 86400 * 20000 + int(hhmm[:2]) * 3600 + int(hhmm[3:]) * 60
    assert open_at(window, t) is ok


def test_a_grant_round_trips_and_hostile_ones_are_one_error() -> None:
    g = grants.Grant(UUID, 2, 1_700_000_000.5, 1_700_000_300.5)
    assert grants.parse(g.encode(), "k") == g
    assert grants.of_node({"metadata": {"annotations": {"k": g.encode()}}}, "k") == g
    assert grants.of_node({"metadata": {}}, "k") is None
    for bad in ("{", "[]", '{"uuid": 1}', '{"uuid":"x","index":-1,"granted_at":1,"until":2}',
                '{"uuid":"x","index":true,"granted_at":1,"until":2}',
                '{"uuid":"x","index":0,"granted_at":"now","until":2}',
                '{"uuid":"x","index":0,"granted_at":1,"until":1e300}',
                "x" * 5000, '{"uuid":' * 50):  # fmt: skip
        with pytest.raises(BadValueError):
            grants.parse(bad, "k")


def test_the_nvml_backend_lets_go_of_nvml_for_the_reset_and_starts_again(tmp_path: Path) -> None:
    """NvmlBackend.reset_gpu against a fake pynvml and a fake nvidia-smi: NVML is shut
    down while the tool runs (an open NVML client keeps the GPU "in use" to it), the
    GPU's own counts start again after a good reset, and the next sample inits again."""
    from gpudaemon.backends.nvml import NvmlBackend
    from tests.unit.fake_nvml import FakeGpu, FakeNvml

    fake = FakeNvml([FakeGpu(), FakeGpu(uuid=UUID)])
    b = NvmlBackend(nvml=fake, xid_events=False)  # type: ignore[arg-type]
    b.inventory()
    b.record_xid(1, 48)
    assert b.sample()[1].health_reason == "xid 48"
    log = tmp_path / "calls"
    tool = fake_tool(
        tmp_path, f'echo "$3" >> {log}\necho "GPU 00000000:28:00.0 was successfully reset."\n'
    )
    before = fake.shutdowns
    r = b.reset_gpu(1, tool, 10)
    assert r.ok and fake.shutdowns == before + 1 and log.read_text() == f"{UUID}\n"
    s = b.sample()  # NVML is initialised again by the next call
    assert s[1].healthy and s[1].xid_errors_total == {}
    # A failed reset keeps the counts: the fault is still there.
    b.record_xid(1, 48)
    r = b.reset_gpu(1, fake_tool(tmp_path, "exit 3\n"), 10)
    assert not r.ok and r.code == 3 and b.sample()[1].health_reason == "xid 48"
    assert not b.reset_gpu(7, tool, 10).ok  # not in the inventory: one line, no tool run
    assert log.read_text() == f"{UUID}\n"
