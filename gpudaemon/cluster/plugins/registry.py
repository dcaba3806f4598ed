"""The one table of the plug-ins, and building a profile from the config (the
extender's and the rebalancer's, from the same `extender.plugins`).

As kube-scheduler's `pkg/scheduler/framework/plugins/registry.go`: every built-in
plug-in is listed here by name, explicitly, and nothing adds itself on import (a
plug-in module only defines its class and its `SPEC`). Every registered policy
(cluster/policies/) is also a score plug-in under its own name. `register` is for
tests and programs that add a plug-in of their own, by an explicit call.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from gpudaemon.cluster.plugins import (
    assume,
    fresh,
    gang,
    gpu_fit,
    healthy,
    healthy_gpus,
    policy,
    reserved,
)
from gpudaemon.cluster.plugins.base import (
    KINDS,
    FilterPlugin,
    Handle,
    Kind,
    PluginSpec,
    PreFilterPlugin,
    ReservePlugin,
    ScorePlugin,
    TierPlugin,
)
from gpudaemon.cluster.policies import known_policies
from gpudaemon.config import PluginsConfig
from gpudaemon.errors import ConfigError

BUILT_IN: tuple[PluginSpec, ...] = (
    fresh.SPEC,
    healthy.SPEC,
    gpu_fit.SPEC,
    reserved.SPEC,
    policy.SPEC,
    healthy_gpus.SPEC,
    gang.SPEC,
    assume.SPEC,
)

_REGISTRY: dict[tuple[Kind, str], PluginSpec] = {(s.kind, s.name): s for s in BUILT_IN}
_LOCK = threading.Lock()


def register(spec: PluginSpec) -> PluginSpec:
    """Add a plug-in; a second one under the same kind and name is a bug, refused."""
    with _LOCK:
        key = (spec.kind, spec.name)
        if key in _REGISTRY and _REGISTRY[key] is not spec:
            raise ValueError(f"{spec.kind} plug-in {spec.name!r} is registered twice")
        _REGISTRY[key] = spec
    return spec


def unregister(kind: Kind, name: str) -> None:
    """Remove a plug-in `register` added (the built-in ones stay)."""
    with _LOCK:
        if (kind, name) in _REGISTRY and _REGISTRY[(kind, name)] not in BUILT_IN:
            del _REGISTRY[(kind, name)]


def registered() -> dict[tuple[Kind, str], PluginSpec]:
    """A copy of the table (for tests and the docs)."""
    with _LOCK:
        return dict(_REGISTRY)


def known_plugins(kind: Kind) -> list[str]:
    with _LOCK:
        names = {n for k, n in _REGISTRY if k == kind}
    if kind == "score":
        names |= set(known_policies())
    return sorted(names)


class UnknownPluginError(ConfigError):
    def __init__(self, kind: Kind, name: str) -> None:
        key = "tiers" if kind == "tier" else kind  # the config key that names it
        super().__init__(
            f"extender.plugins.{key}: unknown {kind} plug-in {name!r}"
            f" (known: {', '.join(known_plugins(kind))})"
        )


def plugin_spec(kind: Kind, name: str) -> PluginSpec:
    with _LOCK:
        spec = _REGISTRY.get((kind, name))
    if spec is not None:
        return spec
    if kind == "score" and name in known_policies():
        return policy.fixed_policy_spec(name)
    raise UnknownPluginError(kind, name)


@dataclass(frozen=True)
class Profile:
    """The enabled plug-ins, in their configured order."""

    pre_filters: tuple[PreFilterPlugin, ...]  # every enabled plug-in with `pre_filter`
    filters: tuple[FilterPlugin, ...]
    scores: tuple[tuple[ScorePlugin, int], ...]  # (plug-in, weight)
    tiers: tuple[TierPlugin, ...]  # compared in this order, before the weighted sum
    reserves: tuple[ReservePlugin, ...]


def _enabled(cfg: PluginsConfig) -> list[tuple[Kind, str]]:
    return [
        *(("filter", n) for n in cfg.filter),
        *(("score", s.name) for s in cfg.score),
        *(("tier", n) for n in cfg.tiers),
        *(("reserve", n) for n in cfg.reserve),
    ]


def _args(spec: PluginSpec, given: Mapping[str, Any], handle: Handle | None) -> Any:
    """The plug-in's arguments: its `extender.plugins.args` section over the defaults
    the handle gives (the older top-level keys)."""
    base = spec.defaults(handle) if handle is not None else {}
    try:
        return spec.args.model_validate({**base, **given})
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise ConfigError(
            f"extender.plugins.args.{spec.name}{'.' + where if where else ''}: {err['msg']}"
        ) from None


def check_plugins(cfg: PluginsConfig) -> None:
    """Every name in `extender.plugins` is registered and every plug-in's arguments
    are valid: a ConfigError naming the known ones otherwise (the extender and the
    rebalancer check at start, before any API call)."""
    specs = {}
    for kind, name in _enabled(cfg):
        specs[name] = plugin_spec(kind, name)
    known = {n for k in KINDS for n in known_plugins(k)}
    for name, given in cfg.args.items():
        if name not in known:
            names = ", ".join(sorted(known))
            raise ConfigError(f"extender.plugins.args: unknown plug-in {name!r} (known: {names})")
        if name in specs:
            _args(specs[name], given, None)


def build_profile(cfg: PluginsConfig, handle: Handle) -> Profile:
    def build(kind: Kind, names: Sequence[str]) -> tuple[Any, ...]:
        out = []
        for n in names:
            spec = plugin_spec(kind, n)
            out.append(spec.factory(handle, _args(spec, cfg.args.get(n, {}), handle)))
        return tuple(out)

    filters = build("filter", cfg.filter)
    scores = build("score", [s.name for s in cfg.score])
    tiers = build("tier", cfg.tiers)
    reserves = build("reserve", cfg.reserve)
    pre: list[PreFilterPlugin] = []
    for p in (*filters, *scores, *tiers, *reserves):
        if hasattr(p, "pre_filter") and p not in pre:
            pre.append(p)
    return Profile(
        tuple(pre),
        filters,
        tuple(zip(scores, (s.weight for s in cfg.score), strict=True)),
        tiers,
        reserves,
    )


__all__ = [
    "BUILT_IN",
    "Profile",
    "UnknownPluginError",
    "build_profile",
    "check_plugins",
    "known_plugins",
    "plugin_spec",
    "register",
    "registered",
    "unregister",
]
