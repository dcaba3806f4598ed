"""Configuration per program (issue 29): each program's model validates the keys it
uses and only the names of the others, so one shared file loads for every program;
unknown keys are refused by all; models do no file I/O (the files are checked when the
program starts: one line, exit 2); `check-config` validates as the programs do."""

from __future__ import annotations

import builtins
import os
import socket
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from gpudaemon.config import (
    PROGRAMS,
    AgentSettings,
    Config,
    ExtenderSettings,
    LabelPrefix,
    check_files,
    load_settings,
)
from gpudaemon.config.values import _View
from gpudaemon.errors import ConfigError
from tests.support import CliResult, run_cli

ALL = frozenset(PROGRAMS)


@pytest.fixture(autouse=True)
def no_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBECONFIG", "/nonexistent")
    monkeypatch.setenv("NODE_NAME", "node-1")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)


def refused_by(data: dict[str, Any]) -> set[str]:
    """The programs whose model refuses `data` (a shared file's contents)."""
    out = set()
    for name, model in PROGRAMS.items():
        try:
            load_settings(model, environ={"NODE_NAME": "node-1"}, overrides=data)
        except ConfigError:
            out.add(name)
    return out


@pytest.mark.parametrize(
    ("data", "programs"),
    [
        ({"influxdb": {"timeout_ms": -1}}, {"agent"}),
        ({"labels": {"to": "apiservr"}}, {"agent"}),
        ({"labels": {"mig_strategy": "half"}}, {"agent"}),
        ({"schedules": {"telemetry": "61 * * * *"}}, {"agent"}),
        ({"metrics": {"listen": "9445"}}, {"agent"}),
        ({"node_name": "Node_1"}, {"agent"}),
        ({"simulate_seed": -1}, {"agent"}),
        ({"extender": {"listen": "host:99999"}}, {"extender", "rebalancer"}),
        ({"extender": {"tls": {"cert_file": "/c"}}}, {"extender", "rebalancer"}),
        ({"rebalance": {"selector": "a in (b)"}}, {"rebalancer"}),
        ({"logging": {"level": "LOUD"}}, {"agent", "extender", "rebalancer"}),
        ({"labels": {"prefix": "Bad Prefix"}}, ALL),
        ({"kubernetes": {"lease_duration_seconds": 1}}, ALL),
    ],
)
def test_each_program_refuses_only_the_mistakes_in_what_it_uses(
    data: dict[str, Any], programs: set[str]
) -> None:
    assert refused_by(data) == programs


@pytest.mark.parametrize(
    ("data", "where"),
    [
        ({"labelz": {}}, "labelz"),
        ({"influxdb": {"urll": "http://x"}}, "influxdb.urll"),
        ({"labels": {"prefx": "a/"}}, "labels.prefx"),
        ({"extender": {"tls": {"certfile": "/c"}}}, "extender.tls.certfile"),
        ({"extender": {"typical_pods": [{"gpus": 1, "gpu": 2}]}}, "extender.typical_pods.0.gpu"),
        ({"rebalance": {"dryrun": True}}, "rebalance.dryrun"),
        ({"logging": {"jsn": True}}, "logging.jsn"),
    ],
)
def test_an_unknown_key_is_refused_by_every_program(data: dict[str, Any], where: str) -> None:
    """As before the split: a typo is a typo wherever it sits and whoever reads the file."""
    for model in PROGRAMS.values():
        with pytest.raises(ConfigError, match=f"{where}: unknown key"):
            load_settings(model, environ={}, overrides=data)


def test_an_unknown_environment_variable_in_a_section_is_refused_by_every_program() -> None:
    for model in PROGRAMS.values():
        with pytest.raises(ConfigError, match=r"influxdb\.urll: unknown key"):
            load_settings(model, environ={"GPUDAEMON_INFLUXDB__URLL": "x"})


def test_the_shared_file_of_the_chart_loads_for_every_program(tmp_path: Path) -> None:
    """Every key of the file set (its defaults, written out), read by each program: each
    sees its own keys with the file's values."""
    f = tmp_path / "shared.yaml"
    data = Config(node_name="node-1").model_dump(by_alias=True, mode="json")
    data["influxdb"].update(url="http://influx:8086", bucket="b", token="t")
    data["extender"]["policy"] = "binpack"
    data["labels"]["prefix"] = "example.com/"
    f.write_text(yaml.safe_dump(data))
    for name, model in PROGRAMS.items():
        cfg: Any = load_settings(model, str(f), environ={})
        assert cfg.labels.prefix == "example.com/", name
        if "extender" in model.model_fields:
            assert cfg.extender.policy == "binpack"
        assert set(type(cfg).model_fields) == set(model.model_fields)


def test_the_programs_together_are_the_whole_file() -> None:
    """Every program field is a field of Config with the same type (or a view of it),
    and every key of Config belongs to some program: the reference docs and the
    chart's schema, generated from Config, cover what the programs read."""
    union: set[str] = set()
    for name, model in PROGRAMS.items():
        for field, info in model.model_fields.items():
            union.add(field)
            whole = Config.model_fields[field].annotation
            mine = info.annotation
            if isinstance(mine, type) and issubclass(mine, _View):
                assert mine.whole() is whole, (name, field)
                assert set(mine.model_fields) < set(whole.model_fields)  # type: ignore[union-attr]
            else:
                assert mine == whole, (name, field)
    assert union == set(Config.model_fields)


def test_the_programs_off_the_gpu_node_see_only_the_label_prefix() -> None:
    cfg = load_settings(ExtenderSettings, environ={}, overrides={"labels": {"to": "stdout"}})
    assert isinstance(cfg.labels, LabelPrefix)
    assert not hasattr(cfg.labels, "to")


# -- files: checked when the program starts, never while a model validates -------------


def test_models_accept_paths_that_do_not_exist_here() -> None:
    """A model is pure: a token file or kubeconfig that exists only in the pod is fine
    on a laptop (they used to be read while validating)."""
    data = {
        "node_name": "node-1",
        "influxdb": {"url": "http://influx:8086", "bucket": "b", "token_file": "/nonexistent/t"},
        "kubernetes": {"kubeconfig": "/nonexistent/kc", "in_cluster": False},
        "extender": {"tls": {"cert_file": "/x/c", "key_file": "/x/k", "client_ca_file": "/x/a"}},
    }
    assert AgentSettings.model_validate(data).influxdb.token_file == "/nonexistent/t"
    assert Config.model_validate(data).extender.tls.enabled


IO = [(builtins, "open"), (os, "open"), (os, "stat"), (os, "lstat"), (os, "fstat")]
IO += [(os.path, "exists"), (os.path, "isfile"), (Path, "is_file"), (Path, "exists")]


def test_validation_touches_no_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Not even an existing one: opening or stat-ing anything while validating fails."""
    tok = tmp_path / "tok"
    tok.write_text("secret\n")
    kc = tmp_path / "kc"
    kc.write_text("")
    data = {
        "node_name": "node-1",
        "influxdb": {"url": "http://influx:8086", "bucket": "b", "token_file": str(tok)},
        "kubernetes": {"kubeconfig": str(kc), "in_cluster": False},
    }
    Config.model_validate(data)  # once, so that every lazy import has happened

    def no_io(*a: object, **k: object) -> None:
        raise AssertionError(f"file I/O while validating: {a}")

    for model in (Config, *PROGRAMS.values()):
        with monkeypatch.context() as m:
            for mod, name in IO:
                m.setattr(mod, name, no_io)
            model.model_validate(data)


def test_check_files_reads_the_token_file_of_the_agent(tmp_path: Path) -> None:
    cfg = AgentSettings.model_validate(
        {"node_name": "n", "influxdb": {"url": "http://i", "bucket": "b", "token_file": "/no/t"}}
    )
    with pytest.raises(ConfigError, match=r"influxdb\.token_file") as e:
        check_files(cfg)
    assert "\n" not in str(e.value)
    # The extender's model has no influxdb section: nothing of the agent's is read.
    check_files(ExtenderSettings.model_validate({"influxdb": {"token_file": "/no/t"}}))


def test_check_files_refuses_a_kubeconfig_that_is_not_a_regular_file(tmp_path: Path) -> None:
    for model in PROGRAMS.values():
        cfg = model.model_validate({"node_name": "n", "kubernetes": {"kubeconfig": str(tmp_path)}})
        with pytest.raises(ConfigError, match=r"kubernetes\.kubeconfig"):
            check_files(cfg)


def one_line_exit_2(p: CliResult, *words: str) -> str:
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def write(tmp_path: Path, data: dict[str, Any]) -> str:
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump(data))
    return str(f)


MISSING_TOKEN = {"influxdb": {"url": "http://127.0.0.1:1", "bucket": "b", "token_file": "/no/t"}}


def test_a_missing_token_file_stops_the_agent_at_start_in_one_line(tmp_path: Path) -> None:
    f = write(tmp_path, MISSING_TOKEN)
    p = run_cli("run", "--once", "--simulate", "dgx-h100", "--labels-to", "none", "--config", f)
    one_line_exit_2(p, "influxdb.token_file", "/no/t")


def test_the_extender_does_not_read_the_agents_token_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shared file with the agent's history settings: the extender's start reads no
    token file (it fails later, for want of a cluster, not on the token)."""
    f = write(tmp_path, MISSING_TOKEN)
    p = run_cli("extender", "--config", f, "--listen", "127.0.0.1:0")
    assert "token_file" not in p.stderr, p.stderr


# -- check-config ---------------------------------------------------------------------


def test_check_config_passes_a_good_shared_file_for_every_program(tmp_path: Path) -> None:
    p = run_cli("check-config", "--config", write(tmp_path, {"extender": {"policy": "spread"}}))
    assert p.returncode == 0, p.stderr
    assert "valid for agent, extender, rebalancer, status" in p.stdout


def test_check_config_names_the_program_and_the_key(tmp_path: Path) -> None:
    f = write(tmp_path, {"influxdb": {"timeout_ms": -1}})
    one_line_exit_2(run_cli("check-config", "--config", f), "agent:", "influxdb.timeout_ms")
    assert run_cli("check-config", "--config", f, "--program", "extender").returncode == 0
    bad = write(tmp_path, {"rebalance": {"dryrun": True}})
    one_line_exit_2(
        run_cli("check-config", "--config", bad, "--program", "status"),
        "status:",
        "rebalance.dryrun: unknown key",
    )


def test_check_config_checks_files_only_when_asked(tmp_path: Path) -> None:
    f = write(tmp_path, MISSING_TOKEN)
    assert run_cli("check-config", "--config", f, "--program", "agent").returncode == 0
    p = run_cli("check-config", "--config", f, "--program", "agent", "--files")
    one_line_exit_2(p, "agent:", "influxdb.token_file")


def test_check_config_uses_the_agents_node_name_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    """As the binaries: the agent needs a Node name, the others do not."""
    monkeypatch.delenv("NODE_NAME")
    monkeypatch.setattr(socket, "gethostname", lambda: "build_box")
    one_line_exit_2(run_cli("check-config"), "agent:", "not a valid Node name")
    assert run_cli("check-config", "--program", "rebalancer").returncode == 0


def test_the_cli_names_the_same_programs_as_the_config() -> None:
    from gpudaemon import cli

    assert tuple(PROGRAMS) == cli.PROGRAMS
    assert all(issubclass(m, BaseModel) for m in PROGRAMS.values())
