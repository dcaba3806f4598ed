"""What only a real `gpudaemon` process shows: argparse's own exit and the stderr a user
sees, and the JSON log format on the process's stderr."""

import json

import pytest

from tests.support import CliResult, cli_process

pytestmark = pytest.mark.integration


def gpudaemon(*args: str) -> CliResult:
    """`gpudaemon <args>` as a real subprocess, outside any cluster."""
    return cli_process(*args, env={"KUBECONFIG": "/nonexistent"})


def test_log_json_writes_one_json_object_per_line() -> None:
    p = gpudaemon("run", "--simulate", "dgx-h100", "--once", "--labels-to", "none", "--log-json")
    assert p.returncode == 0, p.stderr
    lines = p.stderr.strip().splitlines()
    assert lines and all(json.loads(line)["record"]["level"]["name"] for line in lines)
    assert any("gpudaemon starting" in json.loads(line)["text"] for line in lines)


def test_an_unknown_flag_in_a_real_process_is_one_line_and_exit_2() -> None:
    p = gpudaemon("run", "--bogus")
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip().splitlines() == [
        "gpudaemon: error: unrecognized arguments: --bogus (see --help)"
    ]
