"""What `--help` and the docs say about exit codes is what the CLI does (issue 12
item 16), and `--version` works like `version`."""

import re
from pathlib import Path

import pytest

from tests.support import REPO, CliResult, run_cli

ONCE_RULE = (
    "0 when every step succeeded, 1 when one failed (a poll, the label sink, history or "
    "the Lease), 2 on bad input"
)


@pytest.fixture(autouse=True)
def no_cluster_wide_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBECONFIG", "/nonexistent")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("COLUMNS", "200")  # argparse wraps --help to the terminal


def gpudaemon(*args: str) -> CliResult:
    return run_cli(*args)


def one_line(text: str) -> str:
    return " ".join(text.split())


def test_version_flag_prints_what_version_prints() -> None:
    a, b = gpudaemon("--version"), gpudaemon("version")
    assert a.returncode == b.returncode == 0, a.stderr
    assert a.stdout == b.stdout and re.fullmatch(r"gpudaemon \S+\n", a.stdout)


def test_help_and_operations_doc_state_the_same_exit_codes() -> None:
    help_text = one_line(gpudaemon("run", "--help").stdout)
    assert ONCE_RULE in help_text
    assert "then exit 0" not in help_text
    assert ONCE_RULE in one_line((REPO / "docs/operations.md").read_text())


def test_once_exits_0_when_every_step_succeeds(tmp_path: Path) -> None:
    p = gpudaemon("run", "--simulate", "dgx-h100", "--once", "--labels-to", str(tmp_path / "l"))
    assert p.returncode == 0, p.stderr


def test_once_exits_1_when_the_label_sink_fails(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")  # a regular file where a directory is needed: the write fails
    p = gpudaemon("run", "--simulate", "dgx-h100", "--once", "--labels-to", f"{blocker}/labels")
    assert p.returncode == 1, p.stderr
    assert "labels failed" in p.stderr and "Traceback" not in p.stderr


def test_once_exits_2_on_bad_input() -> None:
    p = gpudaemon("run", "--simulate", "no-such-profile", "--once")
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1
