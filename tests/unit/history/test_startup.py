"""`gpudaemon run` with history on and a spool it cannot use must refuse to start (exit 2, one line, no traceback) rather than lose points silently."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpudaemon.history.spool import Spool
from tests.support import CliResult, run_cli

LOCAL = ("--labels-to", "none")


@pytest.fixture(autouse=True)
def no_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBECONFIG", "/nonexistent")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)


def run_once(spool_dir: Path) -> CliResult:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("GPUDAEMON_INFLUXDB__URL", "http://127.0.0.1:9")  # discard: nobody listens
        env.setenv("GPUDAEMON_INFLUXDB__BUCKET", "gpus")
        env.setenv("GPUDAEMON_INFLUXDB__SPOOL_DIR", str(spool_dir))
        return run_cli("run", "--once", "--simulate", "dgx-h100", *LOCAL)


def test_unusable_spool_dir_exits_2_with_one_line_naming_key_path_reason_and_fix(
    tmp_path: Path,
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("a regular file")
    spool = blocker / "spool"
    proc = run_once(spool)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    (line,) = lines
    assert line.startswith(f"gpudaemon: error: influxdb.spool_dir {spool} is not usable")
    assert "(Not a directory)" in line
    assert "mount a writable volume" in line and "set influxdb.spool_dir" in line


def test_usable_spool_dir_keeps_what_influxdb_cannot_take(tmp_path: Path) -> None:
    proc = run_once(tmp_path / "spool")
    assert proc.returncode == 0, proc.stderr
    spool = Spool(tmp_path / "spool", max_bytes=1 << 20)
    assert spool.points == 8  # port 9 refused: spooled, not lost
    spool.close()
