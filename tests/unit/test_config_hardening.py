"""Bad input that used to escape the one-line, exit-2 rule (issue 12 items 7, 8, 9, 11,
12): files that are not regular files, numbers without finite bounds, booleans taken as
numbers, malformed InfluxDB URLs and label outputs that are typos."""

from __future__ import annotations

import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from gpudaemon.backends.simulated import GpuSpec, parse_profile
from gpudaemon.config import Config, load_config
from gpudaemon.errors import ConfigError, ProfileError
from gpudaemon.kube.lease import renew_cron
from gpudaemon.schedule import parse_cron
from tests.support import CliResult, run_cli

GPU = "{name: X, memory_total_mib: 1000, compute_capability: '9.0'"


def gpudaemon(*args: str) -> CliResult:
    """`gpudaemon <args>` in this process, outside any cluster (the files that could hang
    a process are tested on a real one: tests/integration/cli/test_special_files.py)."""
    return run_cli(*args)


def one_line_exit_2(p: CliResult, *words: str) -> None:
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    for w in words:
        assert w in lines[0], lines[0]


@pytest.fixture(autouse=True)
def no_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBECONFIG", "/nonexistent")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)


# -- item 7: size limit (the special files: tests/integration/cli/test_special_files.py) --


def test_config_larger_than_a_mebibyte_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "big.yaml"
    f.write_text("# padding\n" * 200_000)
    one_line_exit_2(gpudaemon("run", "--once", "--config", str(f)), "larger than")


# -- items 8 and 12: every number finite and bounded, booleans are not numbers ----------


def _numeric_fields(
    model: type[BaseModel], path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], type]]:
    """Every int/float field of the config, found by walking the models (a new numeric
    setting is covered without editing this test)."""
    for name, info in model.model_fields.items():
        key = (*path, info.alias or name)
        ann = info.annotation
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        if typing.get_origin(ann) in (typing.Union, types.UnionType) and len(args) == 1:
            ann = args[0]
        if typing.get_origin(ann) is typing.Annotated:
            ann = typing.get_args(ann)[0]
        if typing.get_origin(ann) is list:
            (ann,) = typing.get_args(ann)
            key = (*key, "0")
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from _numeric_fields(ann, key)
        elif ann in (int, float):
            yield key, ann


# The required keys of a list's items, so that only the value under test is wrong.
ITEM_BASE: dict[str, dict[str, Any]] = {"typical_pods": {"gpus": 1}, "score": {"name": "policy"}}


def _override(key: tuple[str, ...], value: object) -> dict[str, Any]:
    out: Any = value
    for i in reversed(range(len(key))):
        part = key[i]
        if part == "0":
            base = ITEM_BASE.get(key[i - 1], {})
            out = [{**base, **out}] if isinstance(out, dict) else [out]
        else:
            out = {part: out}
    return out  # type: ignore[no-any-return]


NUMERIC = list(_numeric_fields(Config))


def test_the_walk_finds_the_numbers_the_issue_names() -> None:
    keys = {".".join(k) for k, _ in NUMERIC}
    assert {
        "kubernetes.request_timeout_seconds",
        "kubernetes.lease_duration_seconds",
        "influxdb.spool_max_bytes",
        "extender.typical_pods.0.weight",
        "simulate_seed",
    } <= keys


@pytest.mark.parametrize(("key", "kind"), NUMERIC, ids=[".".join(k) for k, _ in NUMERIC])
def test_every_numeric_setting_refuses_huge_infinite_and_boolean_values(
    key: tuple[str, ...], kind: type
) -> None:
    bad: list[object] = [True, False, 10**30, -(10**30)]
    if kind is float:
        bad += [float("inf"), float("-inf"), float("nan"), 1e12]
    for value in bad:
        if key == ("extender", "typical_pods", "0", "gpus"):
            override: dict[str, Any] = {"extender": {"typical_pods": [{"gpus": value}]}}
        else:
            override = _override(key, value)
        with pytest.raises(ConfigError) as e:
            load_config(environ={}, overrides=override)
        assert ".".join(k for k in key if k != "0") in str(e.value).replace(".0.", "."), e.value
        assert "\n" not in str(e.value)


def test_the_default_config_is_within_every_bound() -> None:
    load_config(environ={})


@pytest.mark.parametrize("duration", [10, 11, 59, 60, 359, 360, 3599, 14400, 86399, 86400])
def test_every_accepted_lease_duration_gives_a_valid_renew_schedule(duration: int) -> None:
    c = load_config(environ={}, overrides={"kubernetes": {"lease_duration_seconds": duration}})
    parse_cron(renew_cron(c.kubernetes.lease_duration_seconds))


@pytest.mark.parametrize("duration", [9, 86401, 10**12])
def test_lease_duration_outside_its_bounds_is_refused(duration: int) -> None:
    with pytest.raises(ConfigError, match="lease_duration_seconds"):
        load_config(environ={}, overrides={"kubernetes": {"lease_duration_seconds": duration}})


def test_the_largest_accepted_request_timeout_is_usable() -> None:
    """1e12 made every label write fail with OverflowError; the bound must be a timeout
    a socket accepts."""
    import socket

    c = load_config(environ={}, overrides={"kubernetes": {"request_timeout_seconds": 600}})
    with socket.socket() as s:
        s.settimeout(c.kubernetes.request_timeout_seconds)
        s.settimeout(c.kubernetes.connect_timeout_seconds)


@pytest.mark.parametrize(
    "key",
    [("kubernetes", "in_cluster"), ("extender", "avoid_unhealthy_nodes"), ("logging", "json")],
)
def test_switches_are_not_numbers(key: tuple[str, str]) -> None:
    with pytest.raises(ConfigError, match="expected true or false"):
        load_config(environ={}, overrides=_override(key, 1))


def test_environment_strings_still_work_for_numbers_and_switches() -> None:
    env = {
        "GPUDAEMON_INFLUXDB__SPOOL_MAX_BYTES": "1048576",
        "GPUDAEMON_KUBERNETES__REQUEST_TIMEOUT_SECONDS": "2.5",
        "GPUDAEMON_LOGGING__JSON": "true",
    }
    c = load_config(environ=env)
    assert c.influxdb.spool_max_bytes == 1048576
    assert c.kubernetes.request_timeout_seconds == 2.5 and c.logging.json_ is True


def test_spool_max_bytes_true_is_refused_from_the_cli(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("influxdb: {spool_max_bytes: true}\n")
    p = gpudaemon("run", "--once", "--simulate", "dgx-h100", "--config", str(cfg))
    one_line_exit_2(p, "influxdb.spool_max_bytes", "boolean")


@pytest.mark.parametrize(
    "field",
    [
        "memory_total_mib: .inf",
        "memory_total_mib: true",
        "power_max_watts: .inf",
        "power_max_watts: .nan",
        "sm_clock_max_mhz: 1e300",
        "utilization: {pattern: sine, period_s: .inf}",
        "faults: [{kind: lost, after_s: .inf}]",
        "faults: [{kind: xid, count: true}]",
        "nvlink_links: -1",
    ],
)
def test_profile_numbers_are_finite_bounded_and_not_booleans(field: str) -> None:
    with pytest.raises(ProfileError):
        parse_profile(f"gpus: [{GPU}, {field}}}]")


def test_every_profile_number_is_bounded() -> None:
    for name, info in GpuSpec.model_fields.items():
        if info.annotation in (int, float):
            bounds = [m for m in info.metadata if hasattr(m, "le") or hasattr(m, "lt")]
            assert bounds, f"gpus[].{name} has no upper bound"


# -- item 9: influxdb.url ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("ftp://influx:8086", "scheme must be http"),
        ("influx:8086", "scheme must be http"),
        ("localhost", "scheme must be http"),
        ("http://influx:99999", "out of range"),
        ("http://influx:80x", "could not be cast"),
        ("http://influx:", "port must be"),
        ("http://influx:0", "port must be"),
        ("http://", "not a valid host"),
        ("http://bad host:8086", "not a valid host"),
        ("http://bad_host:8086", "not a valid host"),
        ("http://[::g]:8086", "IPv6"),
        ("http://influx:8086/?db=x", "no query"),
    ],
)
def test_bad_influx_urls_are_refused_at_load(url: str, words: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(environ={}, overrides={"influxdb": {"url": url, "bucket": "b"}})
    assert "influxdb.url" in str(e.value) and words in str(e.value), e.value


@pytest.mark.parametrize(
    "url",
    [
        "",
        "http://influx:8086",
        "https://influx.example.com",
        "http://10.0.0.5:8086",
        "http://[::1]:8086",
        "https://example.com/influx",
        "http://user:secret@influx:8086",
    ],
)
def test_good_influx_urls_are_accepted(url: str) -> None:
    assert load_config(environ={}, overrides={"influxdb": {"url": url}}).influxdb.url == url


def test_bad_url_exits_2_from_the_cli_instead_of_failing_forever(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"influxdb: {{url: 'influx:8086', bucket: b, spool_dir: '{tmp_path}/s'}}\n")
    p = gpudaemon(
        "run", "--once", "--simulate", "dgx-h100", "--labels-to", "none", "--config", str(cfg)
    )
    one_line_exit_2(p, "influxdb.url")


# -- item 11: labels.to -------------------------------------------------------------------


@pytest.mark.parametrize("to", ["apiservr", "stdot", "NFD", "labels.json", "none "])
def test_labels_to_that_is_neither_a_word_nor_a_path_is_refused(to: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(environ={}, overrides={"labels": {"to": to}})
    for word in ("apiserver", "stdout", "nfd", "none", "'/'"):
        assert word in str(e.value)


@pytest.mark.parametrize("to", ["apiserver", "stdout", "nfd", "none", "./labels.json", "/x/y"])
def test_labels_to_words_and_paths_are_accepted(to: str) -> None:
    assert load_config(environ={}, overrides={"labels": {"to": to}}).labels.to == to


def test_labels_to_typo_writes_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    p = gpudaemon("run", "--once", "--simulate", "dgx-h100", "--labels-to", "apiservr")
    one_line_exit_2(p, "labels.to", "apiserver, stdout, nfd, none")
    assert not (tmp_path / "apiservr").exists()
