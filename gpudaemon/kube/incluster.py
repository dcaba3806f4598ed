"""A pod's service account as the official client's configuration: the API server from
$KUBERNETES_SERVICE_HOST/PORT, its CA and the bearer token from the mounted directory,
through `kubernetes.config.incluster_config.InClusterConfigLoader`, so a pod's agent,
extender and rebalancer run the same `ApiClient` as a kubeconfig does.

The loader re-reads the token when it is older than its refresh period (a minute, as
client-go does): kubelet rotates bound tokens (hourly by default) and an old one stops
working. Two things are added around its refresh hook: the token is stripped (a file
written by hand ends in a newline, which is no header value), and a token file that
cannot be read at that moment (mid-rotation) keeps the last one instead of failing the
request; the server says 401 if that one is no longer good.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gpudaemon.errors import ConfigError

TOKEN_REREAD_S = 60.0  # client-go's period; a test shortens it to see a rotation
BEARER = "BearerToken"


def in_cluster_configuration(
    sa_dir: Path | None = None, environ: Mapping[str, str] | None = None
) -> Any:
    """The official client's Configuration for this pod's service account, or a
    ConfigError naming what is missing (host, token, CA). `sa_dir` defaults to where
    kubelet mounts it (`gpudaemon.incluster.SA_DIR`, read at call time)."""
    import os

    from kubernetes.client import Configuration
    from kubernetes.config.incluster_config import InClusterConfigLoader

    from gpudaemon import incluster

    sa = incluster.SA_DIR if sa_dir is None else sa_dir
    loader = InClusterConfigLoader(  # type: ignore[no-untyped-call]
        token_filename=str(sa / "token"),
        cert_filename=str(sa / "ca.crt"),
        try_refresh_token=True,
        environ=os.environ if environ is None else environ,
    )
    # The loader's own period (a minute in kubernetes 37); ours so a test can shorten it.
    loader._token_refresh_period = datetime.timedelta(seconds=TOKEN_REREAD_S)
    conf: Any = Configuration()
    try:
        loader.load_and_set(conf)  # type: ignore[no-untyped-call]
    except Exception as e:  # ConfigException, OSError, UnicodeDecodeError: one line
        raise ConfigError(f"in-cluster config ({sa}): {' '.join(str(e).split())}") from None
    _strip(conf)
    refresh = conf.refresh_api_key_hook

    def refresh_token(c: Any) -> None:
        # Unreadable mid-rotation: the last token stays (the loader sets nothing then).
        with contextlib.suppress(Exception):
            refresh(c)  # re-reads the file once the period has passed
        # The loader's hook installs itself again on every refresh: keep ours.
        c.refresh_api_key_hook = refresh_token
        _strip(c)

    conf.refresh_api_key_hook = refresh_token
    conf.retries = False  # our own backoff decides when to try again
    return conf


def _strip(conf: Any) -> None:
    token = conf.api_key.get(BEARER)
    if isinstance(token, str):
        conf.api_key[BEARER] = token.strip()
