"""`gpudaemon run --labels-to nfd` writes GFD's `key=value` lines into NFD's features
directory, the one place NFD's local source reads (issue 39). That directory is on the
host's /etc, so the run happens in a private mount namespace with an overlay on /etc:
the file is written where the agent writes it in a pod, and this machine's /etc is not
touched. Needs root and overlayfs; skipped elsewhere (the refusal of any other path is
in tests/unit/test_cli_destinations.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpudaemon.config import NFD_FEATURES_DIR
from tests.support import REPO

pytestmark = pytest.mark.integration


def test_labels_to_nfd_writes_gfds_lines_into_nfds_directory(tmp_path: Path) -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare for a private mount namespace")
    up, work, seen = tmp_path / "up", tmp_path / "work", tmp_path / "seen"
    up.mkdir()
    work.mkdir()
    target = NFD_FEATURES_DIR + "gpudaemon"
    script = (
        f"mount -t overlay overlay -o lowerdir=/etc,upperdir={up},workdir={work} /etc || exit 77\n"
        f'"{sys.executable}" -m gpudaemon run --simulate dgx-h100 --once --labels-to nfd\n'
        f'rc=$?; cp "{target}" "{seen}"; exit $rc\n'
    )
    env = {**os.environ, "KUBECONFIG": "/nonexistent", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        capture_output=True, text=True, timeout=120, env=env, cwd=REPO,
    )  # fmt: skip
    if proc.returncode == 77 or "unshare failed" in proc.stderr:
        pytest.skip(f"no private overlay on /etc here: {proc.stderr.strip()[:200]}")
    assert proc.returncode == 0, proc.stderr
    lines = seen.read_text().splitlines()
    assert "gpudaemon.io/gpu.count=8" in lines and all("=" in line for line in lines)
    assert not any(line.startswith("gpudaemon.io/gpus=") for line in lines)  # labels only
    # Written in the namespace's /etc (the overlay's upper layer), not this machine's.
    assert (up / target.removeprefix("/etc/")).is_file()
