"""Every read of the process environment for configuration: GPUDAEMON_* variables
(pydantic-settings' reader, nested keys joined by `__`) and the defaults that come
from the environment ($NODE_NAME, $POD_NAME, the hostname, $KUBECONFIG, $HOME,
$KUBERNETES_SERVICE_HOST and the mounted service-account token). Nothing else in
gpudaemon reads these (the official in-cluster loader, called by kube/incluster.py,
still reads KUBERNETES_SERVICE_HOST/PORT for the API server's address in a pod)."""

from __future__ import annotations

import os
import re
import socket
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, get_args

from pydantic import BaseModel
from pydantic_settings import EnvSettingsSource, SettingsError
from pydantic_settings.sources.utils import parse_env_vars

from gpudaemon.errors import ConfigError
from gpudaemon.incluster import SA_TOKEN

ENV_PREFIX = "GPUDAEMON_"

# Once per process: every load of the config in one process names the same leader, and
# two processes (two replicas, or one restarted) never the same.
PROCESS_UUID = str(uuid.uuid4())


class _EnvSource(EnvSettingsSource):
    """pydantic-settings' GPUDAEMON_* reader (nested keys joined by `__`, JSON for
    lists), over an injected mapping instead of the process environment."""

    def __init__(self, model: type[BaseModel], environ: Mapping[str, str]) -> None:
        self._environ = environ
        super().__init__(
            model,  # type: ignore[arg-type]  # a plain model works: only its fields are read
            case_sensitive=False,
            env_prefix=ENV_PREFIX,
            env_nested_delimiter="__",
        )

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return parse_env_vars(self._environ, False, False, None)


def env_overrides(
    environ: Mapping[str, str], model: type[BaseModel] | None = None
) -> dict[str, Any]:
    """GPUDAEMON_INFLUXDB__URL=x -> {"influxdb": {"url": "x"}}, over the keys of
    `model` (default: the whole file, so every program reads every variable and a
    typo is a typo for all; a program then validates only its own).

    Variables whose first part is not a config key (GPUDAEMON_TOOLS_DIR, say) belong
    to someone else and are ignored; a typo inside a known section is an error.
    """
    if model is None:
        from gpudaemon.config.programs import Config

        model = Config
    try:
        return _EnvSource(model, environ)()
    except SettingsError as e:  # e.g. a section or list set to something not JSON
        m = re.search(r'field "(\w+)"', str(e))
        name = f"{ENV_PREFIX}{m.group(1).upper()}" if m else ENV_PREFIX + "*"
        cause = " ".join(str(e.__cause__ or e).split())[:200]
        raise ConfigError(
            f"environment {name}: not a valid value for a section or list "
            f"(set one key with {name}__KEY, or give JSON): {cause}"
        ) from None


def process_environ() -> Mapping[str, str]:
    """The process environment: the one place configuration takes it from."""
    return os.environ


def from_environment(
    data: dict[str, Any], environ: Mapping[str, str], *, node_name: bool = True
) -> dict[str, Any]:
    """The defaults that come from the environment; every such read is here.
    `node_name`: the program has one (the agent)."""
    out = dict(data)
    if node_name and not out.get("node_name"):
        out["node_name"] = environ.get("NODE_NAME") or socket.gethostname().lower()
    kube = out.get("kubernetes")
    if kube is not None and not isinstance(kube, Mapping):
        return out  # not a section: validation names it
    k: dict[str, Any] = dict(kube or {})
    if k.get("in_cluster") is None:
        k["in_cluster"] = bool(environ.get("KUBERNETES_SERVICE_HOST")) and SA_TOKEN.is_file()
    if not k.get("kubeconfig") and k["in_cluster"] is not True:
        home = environ.get("HOME")
        candidates = [*environ.get("KUBECONFIG", "").split(os.pathsep)]
        candidates += [f"{home}/.kube/config"] if home else []
        k["kubeconfig"] = next((c for c in candidates if c and Path(c).is_file()), "")
    # Not a string: left as it is, for validation to name it.
    raw = k.get("holder_identity")
    explicit = raw.strip() if isinstance(raw, str) else raw
    k["holder_identity"] = explicit or environ.get("POD_NAME") or socket.gethostname()
    lead = k.get("leader_identity")
    if not (lead.strip() if isinstance(lead, str) else lead):
        k["leader_identity"] = explicit or f"{k['holder_identity']}_{PROCESS_UUID}"
    out["kubernetes"] = k
    return out


def where_credentials_were_sought(environ: Mapping[str, str] | None = None) -> str:
    """Why no Kubernetes credentials were found, naming every place that was looked at,
    for the one line that says so (the agent's label sink, `status`)."""
    env = process_environ() if environ is None else environ
    if not env.get("KUBERNETES_SERVICE_HOST"):
        pod = "not in a pod, $KUBERNETES_SERVICE_HOST unset"
    elif not SA_TOKEN.is_file():
        pod = f"in a pod without a service-account token at {SA_TOKEN}"
    else:
        pod = "kubernetes.in_cluster false"
    files = [c for c in env.get("KUBECONFIG", "").split(os.pathsep) if c]
    home = env.get("HOME")
    if home:
        files.append(f"{home}/.kube/config")
    where = f"at {' or '.join(files)}" if files else "($KUBECONFIG and $HOME unset)"
    return f"{pod}; no kubeconfig {where}"


def near_misses(
    environ: Mapping[str, str], model: type[BaseModel] | None = None
) -> list[tuple[str, str]]:
    """GPUDAEMON_* variables that no key reads but one would with `__` where a single
    `_` is (GPUDAEMON_INFLUXDB_URL -> GPUDAEMON_INFLUXDB__URL): (variable, likely name).
    Such a variable is ignored, as is any whose first part is not a key (it may be
    another tool's, GPUDAEMON_TOOLS_BIN); these are worth one warning each."""
    if model is None:
        from gpudaemon.config.programs import Config

        model = Config
    out = []
    for name in sorted(environ):
        if not name.upper().startswith(ENV_PREFIX):
            continue
        rest = name[len(ENV_PREFIX) :].lower()
        if rest.split("__")[0] in _keys(model):
            continue  # read (or refused as a typo inside a known section)
        key = _nested_key(rest, model)
        if key is not None:
            out.append((name, ENV_PREFIX + key.upper()))
    return out


def _keys(model: type[BaseModel]) -> dict[str, type[BaseModel] | None]:
    """A model's keys as the file spells them -> the section's model, None for a value."""
    out: dict[str, type[BaseModel] | None] = {}
    for name, field in model.model_fields.items():
        ann = field.annotation
        sub = next(
            (t for t in (ann, *get_args(ann)) if isinstance(t, type) and issubclass(t, BaseModel)),
            None,
        )
        out[field.alias or name] = sub
    return out


def _nested_key(rest: str, model: type[BaseModel]) -> str | None:
    """`influxdb_url` -> `influxdb__url` when that names a key of `model`."""
    keys = _keys(model)
    if rest in keys:
        return rest
    for key, sub in keys.items():
        if sub is None or not rest.startswith(key + "_"):
            continue
        tail = _nested_key(rest[len(key) + 1 :].removeprefix("_"), sub)
        if tail is not None:
            return f"{key}__{tail}"
    return None
