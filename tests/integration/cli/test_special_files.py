"""Files that are not regular files (issue 12 item 7), given to a real `gpudaemon`
process: reading a FIFO or /dev/zero would hang or fill memory, so each case runs in a
process of its own with a timeout, where a regression is a failed test, not a stuck run;
/dev/stdin is the process's own standard input."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import REPO

pytestmark = pytest.mark.integration


def gpudaemon(
    *args: str, cwd: Path = REPO, stdin: Any = subprocess.DEVNULL
) -> subprocess.CompletedProcess[str]:
    """A real CLI run with a timeout: a hang is a failure, not a stuck test run."""
    return subprocess.run(
        [sys.executable, "-m", "gpudaemon", *args],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=cwd,
        stdin=stdin,
        env={**os.environ, "KUBECONFIG": "/nonexistent", "PYTHONPATH": str(REPO)},
    )


def one_line_exit_2(p: subprocess.CompletedProcess[str], *words: str) -> None:
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    for w in words:
        assert w in lines[0], lines[0]


# -- item 7: only regular files, with a size limit ---------------------------------------


@pytest.fixture
def fifo(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "fifo"
    os.mkfifo(path)  # nobody ever writes: reading it would block forever
    yield path


def test_config_that_is_a_fifo_is_refused_without_hanging(fifo: Path) -> None:
    one_line_exit_2(gpudaemon("run", "--once", "--config", str(fifo)), "FIFO", "not a regular")


def test_config_dev_zero_is_refused_without_reading_it() -> None:
    one_line_exit_2(gpudaemon("run", "--once", "--config", "/dev/zero"), "character device")


def test_config_dev_stdin_on_a_pipe_is_refused() -> None:
    p = gpudaemon("run", "--once", "--config", "/dev/stdin", stdin=subprocess.PIPE)
    one_line_exit_2(p, "/dev/stdin", "not a regular file")


def test_config_dev_stdin_redirected_from_a_file_is_read(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("labels: {to: apiservr}\n")
    with f.open() as stdin:  # a regular file: read, and its content validated
        p = gpudaemon(
            "run", "--once", "--simulate", "dgx-h100", "--config", "/dev/stdin", stdin=stdin
        )
    one_line_exit_2(p, "labels.to")


@pytest.mark.parametrize("target", ["fifo", "/dev/zero", "dir"])
def test_token_file_that_is_not_a_regular_file_is_refused_at_load(
    fifo: Path, tmp_path: Path, target: str
) -> None:
    path = {"fifo": str(fifo), "dir": str(tmp_path)}.get(target, target)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f"influxdb: {{url: 'http://127.0.0.1:1', org: o, bucket: b, token_file: '{path}',"
        f" spool_dir: '{tmp_path / 'spool'}'}}\n"
    )
    p = gpudaemon(
        "run", "--once", "--simulate", "dgx-h100", "--labels-to", "none", "--config", str(cfg)
    )
    one_line_exit_2(p, "influxdb.token_file", "not a regular file")


def test_profile_and_kubeconfig_that_are_fifos_are_refused(fifo: Path, tmp_path: Path) -> None:
    one_line_exit_2(gpudaemon("probe", "--simulate", str(fifo)), "profile", "FIFO")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"kubernetes: {{kubeconfig: '{fifo}'}}\n")
    p = gpudaemon("run", "--once", "--simulate", "dgx-h100", "--config", str(cfg))
    one_line_exit_2(p, "kubernetes.kubeconfig", "FIFO")
