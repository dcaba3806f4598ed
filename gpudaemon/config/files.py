"""The configuration's files, checked when a program starts (its wiring), never while
a model validates: a model is pure, so `check-config` on a laptop and a test with a
path that does not exist here validate the same as the pod. Each problem is one
ConfigError line (exit 2), naming the key."""

from __future__ import annotations

import os
from typing import Any, Protocol

from pydantic import SecretStr

from gpudaemon.errors import ConfigError, UsageError
from gpudaemon.textfile import MIB, check_regular_file, read_text_file


class InfluxSecrets(Protocol):
    """What `influx_token` reads of the `influxdb` section (agent.InfluxConfig), named
    here so this module does not import the section's, which imports this one."""

    @property
    def token(self) -> SecretStr: ...

    @property
    def token_file(self) -> str: ...


def influx_token(influxdb: InfluxSecrets) -> str:
    """The token from the environment, else token_file (a regular file of at most
    64 KiB: a FIFO or /dev/zero is one line, not a hang); never logged."""
    if influxdb.token.get_secret_value():
        return influxdb.token.get_secret_value()
    if influxdb.token_file:
        path = influxdb.token_file
        return read_text_file(path, "influxdb.token_file", 64 * 1024, ConfigError).strip()
    return ""


def check_files(cfg: Any) -> None:
    """The files of whichever sections `cfg` (a program's model) has, as its start
    needs them: the InfluxDB token file when history is on, and the kubeconfig (the
    kubernetes library opens it later; /dev/zero or a FIFO would hang there; a missing
    one is reported when the API server sink starts). The extender's TLS files are
    checked where they are loaded (httpserver/tls.py), the simulated profile where it
    is read (backends/simulated.py): both at start, both one line."""
    influxdb = getattr(cfg, "influxdb", None)
    if influxdb is not None and influxdb.url:
        influx_token(influxdb)
    kube = getattr(cfg, "kubernetes", None)
    if kube is not None and kube.kubeconfig and os.path.exists(kube.kubeconfig):
        try:
            check_regular_file(kube.kubeconfig, "kubernetes.kubeconfig", 16 * MIB)
        except UsageError as e:
            raise ConfigError(str(e)) from None
