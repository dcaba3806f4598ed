"""The one table of scoring policies (kube-scheduler's registry.go): every built-in
policy listed by name, explicitly; a policy module only defines its `SPEC` and
registers nothing on import. `register` is for tests and programs that add a policy of
their own, by an explicit call."""

from __future__ import annotations

import threading
from typing import Any

from gpudaemon.cluster.policies import binpack, fragmentation, fragmentation_model, migpack, spread
from gpudaemon.cluster.policies.base import Policy, PolicySpec
from gpudaemon.errors import ConfigError

BUILT_IN: tuple[PolicySpec, ...] = (
    binpack.SPEC,
    spread.SPEC,
    fragmentation.SPEC,
    fragmentation_model.SPEC,
    migpack.SPEC,
)

_REGISTRY: dict[str, PolicySpec] = {s.name: s for s in BUILT_IN}
_LOCK = threading.Lock()


def register(spec: PolicySpec) -> PolicySpec:
    """Add a policy; a second one under the same name is a bug, refused."""
    with _LOCK:
        if spec.name in _REGISTRY and _REGISTRY[spec.name] is not spec:
            raise ValueError(f"policy {spec.name!r} is registered twice")
        _REGISTRY[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    """Remove a policy `register` added (the built-in ones stay)."""
    with _LOCK:
        if name in _REGISTRY and _REGISTRY[name] not in BUILT_IN:
            del _REGISTRY[name]


def known_policies() -> list[str]:
    with _LOCK:
        return sorted(_REGISTRY)


def policy_spec(name: str) -> PolicySpec:
    with _LOCK:
        spec = _REGISTRY.get(name)
    if spec is None:
        raise UnknownPolicyError(name)
    return spec


class UnknownPolicyError(ConfigError):
    def __init__(self, name: str, where: str = "extender.policy") -> None:
        self.name = name
        super().__init__(f"{where}: unknown policy {name!r} (known: {', '.join(known_policies())})")


def build_policies(ext: Any) -> dict[str, Policy]:
    """Every registered policy, built from the config (a pod's annotation may pick any)."""
    with _LOCK:
        specs = list(_REGISTRY.values())
    return {s.name: s.factory(ext) for s in specs}


__all__ = [
    "BUILT_IN",
    "UnknownPolicyError",
    "build_policies",
    "known_policies",
    "policy_spec",
    "register",
    "unregister",
]
