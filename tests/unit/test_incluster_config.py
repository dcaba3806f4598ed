"""The pod's service account as the official client's configuration (kube/incluster.py):
what the official loader reads, the token re-read as kubelet rotates it, and a missing
piece as one configuration error. Against the real server: tests/integration/kube/
test_incluster.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpudaemon.errors import ConfigError
from gpudaemon.kube import incluster as kube_incluster
from gpudaemon.kube.incluster import in_cluster_configuration

ENV = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443"}


def sa_dir(tmp_path: Path, token: str = "token-1\n") -> Path:
    (tmp_path / "token").write_text(token)
    (tmp_path / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\n")
    return tmp_path


def bearer(conf: Any) -> str:
    return str(conf.auth_settings()["BearerToken"]["value"])


def test_host_ca_and_token_come_from_the_layout(tmp_path: Path) -> None:
    conf = in_cluster_configuration(sa_dir(tmp_path), ENV)
    assert conf.host == "https://10.0.0.1:443"
    assert conf.ssl_ca_cert == str(tmp_path / "ca.crt")
    assert bearer(conf) == "bearer token-1"  # the file's newline is no header value
    assert conf.retries is False


def test_an_ipv6_service_address_is_bracketed(tmp_path: Path) -> None:
    env = {**ENV, "KUBERNETES_SERVICE_HOST": "fd00::1"}
    assert in_cluster_configuration(sa_dir(tmp_path), env).host == "https://[fd00::1]:443"


def test_a_rotated_token_is_read_after_the_period(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conf = in_cluster_configuration(sa_dir(tmp_path), ENV)
    (tmp_path / "token").write_text("token-2")
    assert bearer(conf) == "bearer token-1"  # within the minute: the old one
    monkeypatch.setattr(kube_incluster, "TOKEN_REREAD_S", 0.0)
    conf = in_cluster_configuration(sa_dir(tmp_path, "token-2"), ENV)
    (tmp_path / "token").write_text("token-3\n")
    assert bearer(conf) == "bearer token-3"
    (tmp_path / "token").write_text("token-4")  # our hook survives the loader's refresh
    assert bearer(conf) == "bearer token-4"


def test_a_token_unreadable_mid_rotation_keeps_the_last_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kube_incluster, "TOKEN_REREAD_S", 0.0)
    conf = in_cluster_configuration(sa_dir(tmp_path), ENV)
    (tmp_path / "token").unlink()
    assert bearer(conf) == "bearer token-1"
    (tmp_path / "token").write_text("")  # the loader refuses an empty token file
    assert bearer(conf) == "bearer token-1"
    (tmp_path / "token").write_text("token-2")
    assert bearer(conf) == "bearer token-2"


@pytest.mark.parametrize(
    ("env", "remove", "message"),
    [
        ({}, None, "Service host/port is not set"),
        ({**ENV, "KUBERNETES_SERVICE_HOST": ""}, None, "set but empty"),
        (ENV, "token", "token file does not exist"),
        (ENV, "ca.crt", "certification file does not exist"),
    ],
)
def test_a_missing_piece_is_one_configuration_error(
    tmp_path: Path, env: dict[str, str], remove: str | None, message: str
) -> None:
    d = sa_dir(tmp_path)
    if remove:
        (d / remove).unlink()
    with pytest.raises(ConfigError, match=message) as e:
        in_cluster_configuration(d, env)
    assert "\n" not in str(e.value) and str(d) in str(e.value)


def test_the_default_layout_is_read_where_kubelet_mounts_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpudaemon import incluster

    monkeypatch.setattr(incluster, "SA_DIR", sa_dir(tmp_path))
    assert in_cluster_configuration(environ=ENV).ssl_ca_cert == str(tmp_path / "ca.crt")
