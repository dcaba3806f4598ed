"""Sticky GPU faults (issue 17): a critical XID or uncorrected ECC survives an agent
restart until the boot ID changes; a bad record file never stops the agent."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gpudaemon.agent.healthmemory import AnnotationStore, FileStore, HealthMemory
from gpudaemon.backends.base import is_sticky
from gpudaemon.model import GpuSample


def ok(i: int) -> GpuSample:
    return GpuSample(index=i, uuid=f"GPU-{i}")


def sick(i: int, reason: str) -> GpuSample:
    return GpuSample(index=i, uuid=f"GPU-{i}", healthy=False, health_reason=reason)


@pytest.mark.parametrize(
    ("reason", "sticky"),
    [("xid 79", True), ("xid 48", True), ("ecc uncorrected errors", True), ("gpu lost", False)],
)
def test_which_faults_are_remembered(reason: str, sticky: bool) -> None:
    assert is_sticky(reason) is sticky


def test_an_xid_is_still_unhealthy_after_a_restart_on_the_same_boot(tmp_path: Path) -> None:
    f = str(tmp_path / "health.json")
    first = HealthMemory(FileStore(f), "boot-1", clock=lambda: 1000.0)
    first.apply([ok(0), sick(1, "xid 79")])
    # A new process; the GPU no longer reports the fault (NVML only sent an event).
    again = HealthMemory(FileStore(f), "boot-1")
    out = again.apply([ok(0), ok(1)])
    assert [s.healthy for s in out] == [True, False]
    assert out[1].health_reason == "xid 79"


def test_a_new_boot_id_clears_the_record(tmp_path: Path) -> None:
    f = str(tmp_path / "health.json")
    HealthMemory(FileStore(f), "boot-1").apply([sick(1, "xid 79")])
    out = HealthMemory(FileStore(f), "boot-2").apply([ok(0), ok(1)])
    assert all(s.healthy for s in out) and len(out) == 2


def test_a_lost_gpu_is_not_recorded(tmp_path: Path) -> None:
    f = tmp_path / "health.json"
    HealthMemory(FileStore(str(f)), "b").apply([sick(0, "gpu lost")])
    assert not f.exists()


def test_the_first_reason_is_kept(tmp_path: Path) -> None:
    f = str(tmp_path / "health.json")
    m = HealthMemory(FileStore(f), "b")
    m.apply([sick(0, "xid 48")])
    m.apply([sick(0, "xid 79")])
    assert json.loads(Path(f).read_text())["gpus"]["GPU-0"]["reason"] == "xid 48"


@pytest.mark.parametrize("content", [b"{not json", b'{"version": 9}', b"\xff\xfe", b"[]"])
def test_a_corrupt_record_is_one_line_and_the_agent_goes_on(
    tmp_path: Path, content: bytes, lines: list[tuple[str, str]]
) -> None:
    f = tmp_path / "health.json"
    f.write_bytes(content)
    m = HealthMemory(FileStore(str(f)), "b")
    assert m.faults == {}
    errors = [msg for lvl, msg in lines if lvl == "ERROR"]
    assert len(errors) == 1 and "cannot read the GPU fault record" in errors[0]
    m.apply([sick(0, "xid 79")])  # and it records again, replacing the bad file
    assert "GPU-0" in json.loads(f.read_text())["gpus"]


@pytest.mark.parametrize(
    "value",
    [
        "[" * 50_000 + "]" * 50_000,  # a RecursionError for json.loads
        '{"version": 1, "gpus": {"GPU-0": {"reason": "x", "boot_id": "b", "since": 1e999}}}',
        '{"version": 1, "gpus": {"GPU-0": {"reason": "x", "boot_id": "b", "since": '
        + "9" * 400
        + "}}}",
        "x" * (300 * 1024),
    ],
    ids=["deep", "infinity", "huge-int", "over-256KiB"],
)
def test_a_hostile_fault_annotation_is_one_line_at_start_up(
    value: str, lines: list[tuple[str, str]]
) -> None:
    """The record read back off the Node is bounded like every value a node writes."""
    store = AnnotationStore("gpudaemon.io/gpu-faults")
    store.seed({"metadata": {"annotations": {"gpudaemon.io/gpu-faults": value}}})
    m = HealthMemory(store, "b")
    assert m.faults == {}
    errors = [msg for lvl, msg in lines if lvl == "ERROR"]
    assert len(errors) == 1 and "cannot read the GPU fault record" in errors[0]


def test_a_symlink_is_neither_read_nor_written_through(
    tmp_path: Path, lines: list[tuple[str, str]]
) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    link = tmp_path / "health.json"
    link.symlink_to(victim)
    m = HealthMemory(FileStore(str(link)), "b")
    out = m.apply([sick(0, "xid 79")])
    assert victim.read_text() == "precious" and link.is_symlink()
    assert not out[0].healthy  # kept in memory
    assert any("cannot record a GPU fault" in msg for _, msg in lines)


def test_an_unwritable_directory_keeps_the_fault_in_memory(tmp_path: Path) -> None:
    d = tmp_path / "ro"
    d.mkdir()
    os.chmod(d, 0o500)
    try:
        m = HealthMemory(FileStore(str(d / "sub" / "health.json")), "b")
        out = m.apply([sick(0, "xid 79")])
        out = m.apply([ok(0)])
        if os.geteuid() != 0:  # root ignores the mode bits
            assert not (d / "sub").exists()
        assert not out[0].healthy
    finally:
        os.chmod(d, 0o700)
