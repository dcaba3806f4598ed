"""`run` never falls back quietly (issue 39): a label destination the user asked for and
cannot have is one line naming it and exit 2; the default destination without
credentials falls back to stdout with one line saying why, naming where it looked; a
GPUDAEMON_* variable one `_` short of a key gets one warning naming the likely key; an
NFD feature file outside NFD's directory is refused; and the help lists every policy
and built-in profile from their registries."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gpudaemon.backends.simulated.profile import BUILTIN_PROFILES
from gpudaemon.cluster.policies import known_policies
from gpudaemon.config import NFD_FEATURES_DIR, AgentSettings, load_settings
from gpudaemon.config.environment import near_misses
from gpudaemon.errors import ConfigError
from gpudaemon.labels import LabelSet
from gpudaemon.labels.outputs import NfdSink
from gpudaemon.labels.sanitize import Labels
from tests.support import run_cli

ONCE = ("run", "--simulate", "dgx-h100", "--once")


@pytest.fixture(autouse=True)
def no_cluster(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Not in a pod, $KUBECONFIG naming a file that is not there, no ~/.kube/config."""
    monkeypatch.setenv("KUBECONFIG", "/nonexistent/kubeconfig")
    monkeypatch.setenv("HOME", "/nonexistent-home")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    for name in ("GPUDAEMON_LABELS__TO", "GPUDAEMON_KUBERNETES__KUBECONFIG"):
        monkeypatch.delenv(name, raising=False)
    yield


def one_error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("gpudaemon: error: "), stderr
    return lines[0]


# -- labels.to apiserver without credentials ---------------------------------------------


def test_the_default_destination_falls_back_to_stdout_in_one_line_naming_why() -> None:
    p = run_cli(*ONCE)
    assert p.returncode == 0, p.stderr
    assert "gpudaemon.io/gpu.count" in p.stdout
    (line,) = [x for x in p.stderr.splitlines() if "writing labels to stdout" in x]
    assert "labels.to is not set" in line
    assert "$KUBERNETES_SERVICE_HOST unset" in line
    assert "/nonexistent/kubeconfig" in line and "/nonexistent-home/.kube/config" in line


@pytest.mark.parametrize("how", ["flag", "environment", "config file"])
def test_apiserver_asked_for_without_credentials_is_one_line_and_exit_2(
    how: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    args = list(ONCE)
    if how == "flag":
        args += ["--labels-to", "apiserver"]
    elif how == "environment":
        monkeypatch.setenv("GPUDAEMON_LABELS__TO", "apiserver")
    else:
        cfg = tmp_path / "c.yaml"
        cfg.write_text("labels: {to: apiserver}\n")
        args += ["--config", str(cfg)]
    p = run_cli(*args)
    assert p.returncode == 2 and p.stdout == ""
    line = one_error_line(p.stderr)
    assert "labels.to is apiserver" in line and "no Kubernetes credentials" in line
    assert "/nonexistent/kubeconfig" in line  # where it looked


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_a_named_kubeconfig_that_does_not_exist_is_one_line_naming_it(
    how: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    missing = str(tmp_path / "no-such-kubeconfig")
    args = list(ONCE)
    if how == "flag":
        args += ["--kubeconfig", missing]
    else:
        monkeypatch.setenv("GPUDAEMON_KUBERNETES__KUBECONFIG", missing)
    p = run_cli(*args)
    assert p.returncode == 2 and p.stdout == ""
    line = one_error_line(p.stderr)
    assert f"kubernetes.kubeconfig {missing}: no such file" in line


def test_run_takes_kubeconfig_as_status_and_rebalance_do(tmp_path: Path) -> None:
    kc = tmp_path / "kc"
    kc.write_text("apiVersion: v1\nkind: Config\n")
    from gpudaemon.cli import _RUN_FLAGS, _overrides, build_parser

    args = build_parser().parse_args(["run", "--kubeconfig", str(kc)])
    assert _RUN_FLAGS["kubeconfig"] == ("kubernetes", "kubeconfig")
    cfg = load_settings(AgentSettings, None, environ={}, overrides=_overrides(args))
    assert cfg.kubernetes.kubeconfig == str(kc)


def test_status_without_credentials_names_where_it_looked() -> None:
    p = run_cli("status")
    assert p.returncode == 2
    line = one_error_line(p.stderr)
    assert "no Kubernetes credentials" in line and "/nonexistent/kubeconfig" in line


# -- GPUDAEMON_* near misses ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("variable", "likely"),
    [
        ("GPUDAEMON_INFLUXDB_URL", "GPUDAEMON_INFLUXDB__URL"),
        ("GPUDAEMON_LABELS_TO", "GPUDAEMON_LABELS__TO"),
        ("GPUDAEMON_KUBERNETES_KUBECONFIG", "GPUDAEMON_KUBERNETES__KUBECONFIG"),
        ("GPUDAEMON_EXTENDER_TLS_CERT_FILE", "GPUDAEMON_EXTENDER__TLS__CERT_FILE"),
        ("GPUDAEMON_LOGGING_JSON", "GPUDAEMON_LOGGING__JSON"),  # the key's alias
        ("gpudaemon_schedules_telemetry", "GPUDAEMON_SCHEDULES__TELEMETRY"),
    ],
)
def test_a_variable_one_underscore_short_of_a_key_is_named_with_the_likely_key(
    variable: str, likely: str
) -> None:
    assert near_misses({variable: "x"}) == [(variable, likely)]


@pytest.mark.parametrize(
    "variable",
    [
        "GPUDAEMON_INFLUXDB__URL",  # read
        "GPUDAEMON_NODE_NAME",  # a top-level key with an underscore of its own
        "GPUDAEMON_TOOLS_BIN",  # another tool's
        "GPUDAEMON_IMAGE_DIR",
        "GPUDAEMON_INFLUXDB_NOSUCHKEY",  # near nothing
        "OTHER_INFLUXDB_URL",
    ],
)
def test_a_variable_that_is_read_or_near_no_key_gets_no_warning(variable: str) -> None:
    assert near_misses({variable: "x"}) == []


def test_the_agent_warns_once_per_near_miss_naming_the_likely_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GPUDAEMON_INFLUXDB_URL", "http://influx:8086")
    p = run_cli(*ONCE, "--labels-to", "none")
    assert p.returncode == 0, p.stderr
    lines = [x for x in p.stderr.splitlines() if "GPUDAEMON_INFLUXDB_URL" in x]
    assert len(lines) == 1 and "WARNING" in lines[0], p.stderr
    assert "did you mean GPUDAEMON_INFLUXDB__URL?" in lines[0]


def test_check_config_warns_about_a_near_miss_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUDAEMON_LABELS_PREFIX", "gpu.example.com/")
    p = run_cli("check-config")
    assert p.returncode == 0, p.stderr
    assert "did you mean GPUDAEMON_LABELS__PREFIX?" in p.stderr


# -- labels.to nfd -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        "/tmp/features.d/gpudaemon",
        "/etc/kubernetes/node-feature-discovery/features.d/",  # the directory itself
        "/etc/kubernetes/node-feature-discovery/features.d/.gpudaemon",  # NFD skips it
        "/etc/kubernetes/node-feature-discovery/features.d/sub/gpudaemon",  # not read
        "/etc/kubernetes/node-feature-discovery/features.d/../gpudaemon",
        "/etc/kubernetes/node-feature-discovery/source.d/gpudaemon",
        "features.d/gpudaemon",
    ],
)
def test_an_nfd_path_outside_nfds_features_directory_is_one_line_and_exit_2(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checked as the agent loads its config (check-config: a regression must not make
    this test write into this machine's /etc)."""
    monkeypatch.setenv("GPUDAEMON_LABELS__NFD_PATH", path)
    p = run_cli("check-config", "--program", "agent")
    assert p.returncode == 2 and p.stdout == ""
    line = one_error_line(p.stderr)
    assert "labels.nfd_path" in line and NFD_FEATURES_DIR in line
    assert f"e.g. {NFD_FEATURES_DIR}gpudaemon" in line


def test_run_labels_to_nfd_outside_the_directory_writes_nothing_and_exits_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "features.d" / "gpudaemon"
    monkeypatch.setenv("GPUDAEMON_LABELS__NFD_PATH", str(out))
    p = run_cli(*ONCE, "--labels-to", "nfd")
    assert p.returncode == 2 and p.stdout == ""
    assert "labels.nfd_path" in one_error_line(p.stderr)
    assert not out.exists()


def test_the_default_nfd_path_and_any_file_in_the_directory_are_accepted() -> None:
    assert AgentSettings.model_validate({"node_name": "n"}).labels.nfd_path == (
        NFD_FEATURES_DIR + "gpudaemon"
    )
    for name in ("gpu-labels", "gpudaemon.features"):
        data = {"node_name": "n", "labels": {"to": "nfd", "nfd_path": NFD_FEATURES_DIR + name}}
        assert AgentSettings.model_validate(data).labels.nfd_path.endswith(name)
    with pytest.raises(ConfigError, match=r"labels\.nfd_path"):
        load_settings(AgentSettings, environ={}, overrides={"labels": {"nfd_path": "/tmp/x"}})


def test_the_nfd_sink_writes_gfds_format(tmp_path: Path) -> None:
    out = tmp_path / "features.d" / "gpudaemon"
    labels = Labels("gpudaemon.io/", {"gpu.count": "8"})
    NfdSink(str(out)).apply(LabelSet(labels, {"gpudaemon.io/gpus": "[]"}))
    assert out.read_text() == "gpudaemon.io/gpu.count=8\n"  # labels only, no annotation


# -- help from the registries --------------------------------------------------------------


@pytest.mark.parametrize("command", ["run", "probe"])
def test_help_lists_every_built_in_profile(command: str) -> None:
    p = run_cli(command, "--help")
    assert p.returncode == 0
    text = " ".join(p.stdout.split())
    assert "h100-measured" in BUILTIN_PROFILES
    assert [name for name in BUILTIN_PROFILES if name not in text] == []


def test_extender_help_lists_every_policy() -> None:
    p = run_cli("extender", "--help")
    assert p.returncode == 0
    text = " ".join(p.stdout.split())
    assert "migpack" in known_policies()
    assert " | ".join(known_policies()) in text


def test_run_help_says_where_nfd_writes() -> None:
    text = " ".join(run_cli("run", "--help").stdout.replace("-\n", "-").split())
    assert "labels.nfd_path" in text and "features.d/gpudaemon" in text
    assert "--kubeconfig FILE" in text
