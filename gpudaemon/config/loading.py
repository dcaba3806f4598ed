"""Loading: the YAML file, then GPUDAEMON_* environment variables, then CLI flags,
then the defaults the environment gives, validated by one model: a program's
(`load_settings(ExtenderSettings, ...)`) or the whole file's (`load_config`). Any
problem becomes one ConfigError line that names the key. Files the configuration
names are checked later, when the program starts (files.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from gpudaemon.config.environment import env_overrides, from_environment, process_environ
from gpudaemon.config.programs import Config
from gpudaemon.errors import ConfigError
from gpudaemon.textfile import MIB, read_text_file

M = TypeVar("M", bound=BaseModel)


def _deep_merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def read_file(path: str) -> dict[str, Any]:
    """The YAML file's top-level mapping. Only a regular file, at most 1 MiB:
    /dev/zero, a FIFO or /dev/stdin on a pipe or terminal are one line and exit 2,
    not a hang or a MemoryError."""
    text = read_text_file(path, "config file", MIB, ConfigError)
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path}: invalid YAML: {' '.join(str(e).split())}") from None
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"config file {path}: expected a mapping at the top level")
    return loaded or {}


def load_settings(
    model: type[M],
    path: str | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> M:
    """`model` (a program's, or Config) from `path`, the environment and `overrides`."""
    data = read_file(path) if path else {}
    env = process_environ() if environ is None else environ
    data = _deep_merge(data, env_overrides(env))
    data = _deep_merge(data, overrides or {})
    data = from_environment(data, env, node_name="node_name" in model.model_fields)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_describe(e, path)) from None


def load_config(
    path: str | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """The whole file, every program's keys validated (the node name as the agent
    needs it): for tests, benches and tools that build several programs from one."""
    return load_settings(Config, path, environ, overrides)


def _describe(e: ValidationError, path: str | None) -> str:
    err = e.errors()[0]
    loc = ".".join(str(p) for p in err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        msg = "unknown key"
    where = f"config {path}" if path else "config"
    extra = f" (and {len(e.errors()) - 1} more)" if len(e.errors()) > 1 else ""
    return f"{where}: {loc + ': ' if loc else ''}{msg}{extra}"
