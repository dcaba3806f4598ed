"""The CLI as users run it: exit codes, one-line errors, no tracebacks.

Every case runs `gpudaemon.cli.main` in this process (an interpreter start costs more than
the case itself); what only a real process shows (argparse's exit, the stderr a user sees,
the log format) is in tests/integration/cli/test_process.py."""

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import run_cli


@pytest.fixture(autouse=True)
def no_cluster(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No kubeconfig, no in-cluster identity: labels fall back to stdout."""
    monkeypatch.setenv("KUBECONFIG", "/nonexistent")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    yield


def test_probe_json_reports_eight_gpus_with_labels_and_annotation() -> None:
    p = run_cli("probe", "--simulate", "dgx-h100", "--format", "json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert {"gpus", "labels", "annotations"} <= set(d)
    assert len(d["gpus"]) == 8
    assert d["labels"]["gpudaemon.io/gpu.count"] == "8"
    assert len(json.loads(d["annotations"]["gpudaemon.io/gpus"])) == 8


def test_probe_table() -> None:
    p = run_cli("probe", "--simulate", "a100-mig")
    assert p.returncode == 0 and "gpudaemon.io/mig.enabled=true" in p.stdout


def test_run_once_exits_zero_and_prints_labels() -> None:
    p = run_cli("run", "--simulate", "dgx-h100", "--once", "--labels-to", "stdout")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["labels"]["gpudaemon.io/gpu.product"] == "NVIDIA-H100-80GB-HBM3"


def test_run_once_with_default_sink_and_no_cluster_falls_back_to_stdout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HOME", "/nonexistent")
    p = run_cli("run", "--simulate", "dgx-h100", "--once")
    assert p.returncode == 0, p.stderr
    assert "writing labels to stdout" in p.stderr and "gpudaemon.io/gpu.count" in p.stdout


# `--labels-to nfd` writes only into NFD's own directory: tests/unit/test_cli_destinations.py
# (the refusal) and tests/integration/cli/test_nfd.py (the file, in a private mount).


def test_version() -> None:
    p = run_cli("version")
    assert p.returncode == 0 and p.stdout.startswith("gpudaemon ")


def _nvml_present() -> bool:
    from gpudaemon.backends.nvml import NvmlBackend
    from gpudaemon.errors import GpudaemonError

    try:
        NvmlBackend(xid_events=False).inventory()
    except GpudaemonError:
        return False
    return True


NEEDS_NO_NVML = pytest.mark.skipif(
    _nvml_present(), reason="this machine has NVML: the missing-driver path cannot happen here"
)

BAD = [
    (["run", "--bogus"], "unrecognized arguments"),
    (["probe", "--format", "xml"], "invalid choice"),
    (["probe", "--simulate", "no-such-profile"], "unknown simulation profile"),
    (["run", "--simulate", "no-such-profile", "--once"], "unknown simulation profile"),
    pytest.param(
        ["run", "--once", "--labels-to", "stdout"], "NVML is not available", marks=NEEDS_NO_NVML
    ),
    pytest.param(["probe"], "NVML is not available", marks=NEEDS_NO_NVML),
    (["run", "--config", "/nonexistent.yaml"], "No such file"),
    (["run", "--config", "/bin/sh"], "not a UTF-8 text file"),
    (["probe", "--simulate", "/bin/sh"], "not a UTF-8 text file"),
    (["run", "--listen", "nowhere", "--simulate", "dgx-h100"], "metrics.listen"),
    (
        ["run", "--listen", "300.1.1.1:9999", "--simulate", "dgx-h100", "--labels-to", "none"],
        "metrics.listen: cannot listen on 300.1.1.1:9999",
    ),
    (["run", "--seed", "abc"], "invalid int value"),
    (["probe", "--simulate", "dgx-h100", "--prefix", "Not A Prefix"], "--prefix"),
    (
        ["run", "--simulate", "dgx-h100", "--once", "--node-name", "a/status"],
        "not a valid Node name",
    ),
    (["run", "--simulate", "dgx-h100", "--once", "--node-name", "Node_1"], "not a valid Node name"),
]


@pytest.mark.parametrize(("args", "message"), BAD)
def test_bad_input_is_one_line_and_exit_2(args: list[str], message: str) -> None:
    p = run_cli(*args)
    assert p.returncode == 2, (p.returncode, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], p.stderr
    assert lines[0].startswith(
        ("gpudaemon: error:", "gpudaemon run: error:", "gpudaemon probe: error:")
    )


def test_listen_address_in_use_is_exit_2(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        p = run_cli(
            "run", "--simulate", "dgx-h100", "--labels-to", "none", "--listen", f"127.0.0.1:{port}"
        )
    assert p.returncode == 2 and "Address already in use" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("profile", "message"),
    [
        (
            "gpus: [{name: X, memory_total_mib: 1, compute_capability: '9.0'}]\ncuda_version: '12.x'",
            "cuda_version: must look like",
        ),
        (
            "gpus: [{name: X, memory_total_mib: 1, compute_capability: '9.0'}]\nfaults: [{kind: lost}]",
            "faults[0]: node-level faults need 'gpu'",
        ),
        (
            "gpus: [{name: X, memory_total_mib: 1, compute_capability: '9.0', count: 2}]\n"
            "faults: [{kind: lost, gpu: 2}]",
            "index 0..1",
        ),
    ],
)
def test_bad_profile_values_exit_2(tmp_path: Path, profile: str, message: str) -> None:
    f = tmp_path / "p.yaml"
    f.write_text(profile)
    for cmd in (["probe", "--simulate", str(f)], ["run", "--once", "--simulate", str(f)]):
        p = run_cli(*cmd)
        assert p.returncode == 2 and message in p.stderr, p.stderr
        assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("schedules: {telemetry: '*/5 * * *'}", "invalid cron expression"),
        ("labels: {bogus: 1}", "labels.bogus: unknown key"),
    ],
)
def test_bad_config_file_exit_2(tmp_path: Path, config: str, message: str) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(config)
    p = run_cli("run", "--config", str(f), "--simulate", "dgx-h100")
    assert p.returncode == 2 and message in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_bad_profile_file_exit_2(tmp_path: Path) -> None:
    f = tmp_path / "p.yaml"
    f.write_text("gpus: [{name: X}]")
    p = run_cli("probe", "--simulate", str(f))
    assert p.returncode == 2 and "memory_total_mib" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_labels_to_none_runs_metrics_only() -> None:
    p = run_cli("run", "--simulate", "dgx-h100", "--once", "--labels-to", "none")
    assert p.returncode == 0, p.stderr
    assert p.stdout == "" and "labels->none" in p.stderr


def test_probe_reads_simulate_and_prefix_from_the_config_file(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("simulate: a100-mig\nsimulate_seed: 3\nlabels: {prefix: example.com/}\n")
    p = run_cli("probe", "--config", str(cfg), "--format", "json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["labels"]["example.com/mig.enabled"] == "true"
    assert not any(k.startswith("gpudaemon.io/") for k in d["labels"])
    # flags still win over the file
    p = run_cli("probe", "--config", str(cfg), "--format", "json", "--prefix", "x.io/")
    assert "x.io/gpu.count" in json.loads(p.stdout)["labels"]
