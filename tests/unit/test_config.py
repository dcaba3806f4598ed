"""Configuration: YAML < environment < flags, validated at load, one-line errors."""

import socket
from pathlib import Path

import pytest

from gpudaemon.config import (
    AgentSettings,
    ExtenderSettings,
    RebalancerSettings,
    StatusSettings,
    load_config,
    load_settings,
)
from gpudaemon.errors import ConfigError


def write(tmp_path: Path, text: str) -> str:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return str(p)


def test_defaults_match_the_brief(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(socket, "gethostname", lambda: "host-a")
    c = load_config(environ={})
    assert c.schedules.telemetry == "*/5 * * * * *" and c.schedules.inventory == "0 */5 * * * *"
    assert c.labels.prefix == "gpudaemon.io/" and c.labels.to == "apiserver"
    assert c.metrics.listen == "0.0.0.0:9445" and c.extender.listen == "0.0.0.0:9446"
    assert c.influxdb.spool_max_bytes == 268435456 and c.simulate is None
    assert c.node_name == "host-a"  # hostname fallback
    assert c.kubernetes.holder_identity == "host-a" and c.kubernetes.kubeconfig == ""
    assert c.kubernetes.in_cluster is False


def test_precedence_file_then_env_then_flags(tmp_path: Path) -> None:
    f = write(
        tmp_path,
        "node_name: from-file\ninfluxdb: {url: http://file, org: o}\n"
        "schedules: {labels: '*/10 * * * * *'}\n",
    )
    env = {
        "GPUDAEMON_INFLUXDB__URL": "http://env",
        "GPUDAEMON_NODE_NAME": "from-env",
        "GPUDAEMON_METRICS__STALE_AFTER_SECONDS": "12.5",
    }
    c = load_config(f, environ=env, overrides={"node_name": "from-flag"})
    assert c.node_name == "from-flag"
    assert c.influxdb.url == "http://env" and c.influxdb.org == "o"
    assert c.metrics.stale_after_seconds == 12.5
    assert c.schedules.labels == "*/10 * * * * *"


def test_environment_defaults_come_from_the_injected_environ(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("NODE_NAME", "from-process")  # must not leak in
    monkeypatch.setattr(socket, "gethostname", lambda: "host-a")
    assert load_config(environ={}).node_name == "host-a"
    kc = tmp_path / "kc"
    kc.write_text("")
    env = {"NODE_NAME": "n-7", "POD_NAME": "agent-x", "KUBECONFIG": f"/nonexistent:{kc}"}
    c = load_config(environ=env)
    assert c.node_name == "n-7"
    assert c.kubernetes.holder_identity == "agent-x"
    assert c.kubernetes.kubeconfig == str(kc)  # the first file that exists
    home = tmp_path / "home"
    (home / ".kube").mkdir(parents=True)
    (home / ".kube" / "config").write_text("")
    c = load_config(environ={"HOME": str(home)})
    assert c.kubernetes.kubeconfig == str(home / ".kube" / "config")
    # An explicit file wins; outside a pod there is no in-cluster identity.
    c = load_config(
        environ={"HOME": str(home), "KUBERNETES_SERVICE_HOST": "10.0.0.1"},
        overrides={"kubernetes": {"kubeconfig": "/etc/kc"}},
    )
    assert c.kubernetes.kubeconfig == "/etc/kc" and c.kubernetes.in_cluster is False


def test_unrelated_gpudaemon_env_vars_are_ignored() -> None:
    plain = load_config(environ={"NODE_NAME": "n"})
    other = load_config(
        environ={"NODE_NAME": "n", "GPUDAEMON_TOOLS_DIR": "/x", "GPUDAEMON_TOOLS_BIN": "/y"}
    )
    assert other == plain


def test_environment_values_are_parsed_like_the_file() -> None:
    env = {
        "NODE_NAME": "n",
        "GPUDAEMON_KUBERNETES__LEASE_DURATION_SECONDS": "50",
        "GPUDAEMON_EXTENDER__TYPICAL_PODS": '[{"gpus": 2}]',
        "GPUDAEMON_LOGGING__JSON": "true",
        "GPUDAEMON_EXTENDER__LISTEN": "[::1]:9446",
    }
    c = load_config(environ=env)
    assert c.kubernetes.lease_duration_seconds == 50
    assert c.extender.typical_pods[0].gpus == 2
    assert c.logging.json_ is True and c.extender.listen == "[::1]:9446"


def test_token_is_secret_and_read_from_file(tmp_path: Path) -> None:
    tok = tmp_path / "tok"
    tok.write_text("s3cret\n")
    c = load_config(environ={"GPUDAEMON_INFLUXDB__TOKEN_FILE": str(tok)})
    assert c.influx_token() == "s3cret"
    c2 = load_config(environ={"GPUDAEMON_INFLUXDB__TOKEN": "envtok"})
    assert c2.influx_token() == "envtok"
    assert "envtok" not in repr(c2) and "envtok" not in str(c2.model_dump())


@pytest.mark.parametrize(
    ("text", "env", "message"),
    [
        (
            "schedules: {telemetry: '61 * * * *'}",
            {},
            "schedules.telemetry: invalid cron expression",
        ),
        ("schedules: {history: 'every minute'}", {}, "schedules.history: invalid cron expression"),
        ("labelz: {}", {}, "labelz: unknown key"),
        ("labels: {prefx: a/}", {}, "labels.prefx: unknown key"),
        ("labels: {prefix: 'Bad Prefix'}", {}, "labels.prefix"),
        ("metrics: {listen: 9445}", {}, "metrics.listen: '9445' has no port"),
        ("extender: {listen: 'host:99999'}", {}, "extender.listen: 'host:99999': port must"),
        ("kubernetes: {lease_duration_seconds: true}", {}, "expected a whole number"),
        ("kubernetes: {lease_duration_seconds: 1.5}", {}, "kubernetes.lease_duration_seconds"),
        ("", {"GPUDAEMON_EXTENDER__TYPICAL_PODS": "[not json"}, "GPUDAEMON_EXTENDER"),
        # extender: {policy: random} is refused by the extender, against its policy registry
        # (config.py does not import the extender): tests/unit/extender/test_registry.py
        ("influxdb: {spool_max_bytes: -1}", {}, "influxdb.spool_max_bytes"),
        ("logging: {level: LOUD}", {}, "logging.level"),
        ("node_name: [a, b]", {}, "node_name"),
        ("just a string", {}, "expected a mapping"),
        ("a: [", {}, "invalid YAML"),
        ("", {"GPUDAEMON_INFLUXDB__URLL": "x"}, "influxdb.urll: unknown key"),
        ("", {"GPUDAEMON_METRICS__STALE_AFTER_SECONDS": "soon"}, "metrics.stale_after_seconds"),
    ],
)
def test_bad_config_is_one_line_naming_the_key(
    tmp_path: Path, text: str, env: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, text), environ=env)
    assert message in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def test_missing_config_file() -> None:
    with pytest.raises(ConfigError, match="No such file"):
        load_config("/nonexistent/gpudaemon.yaml", environ={})


def test_node_name_from_hostname_is_lower_cased(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(socket, "gethostname", lambda: "GPU-Node-7")
    assert load_config(environ={}).node_name == "gpu-node-7"


@pytest.mark.parametrize("name", ["a/status", "Node_1", "x?y", "-lead", "a" * 254])
def test_invalid_node_names_are_refused(name: str) -> None:
    with pytest.raises(ConfigError, match="not a valid Node name"):
        load_config(environ={}, overrides={"node_name": name})


def test_programs_off_the_gpu_node_do_not_need_a_node_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The extender, the rebalancer and `status` run where the hostname may be no Node
    name (an underscore); only the agent, which writes its Node, needs one."""
    monkeypatch.setattr(socket, "gethostname", lambda: "build_box")
    with pytest.raises(ConfigError, match="not a valid Node name"):
        load_config(environ={})
    with pytest.raises(ConfigError, match="not a valid Node name"):
        load_settings(AgentSettings, environ={})
    assert load_settings(ExtenderSettings, environ={}).extender.listen
    assert load_settings(RebalancerSettings, environ={}).rebalance.listen
    assert load_settings(StatusSettings, environ={}).labels.prefix
