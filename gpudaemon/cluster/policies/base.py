"""The policy interface and the registry every policy adds itself to.

As in kube-scheduler's framework registry: a policy is one module under
`cluster/policies/` that calls `register(PolicySpec(...))` with its name, a factory
from the `extender:` config section, a one-line summary (the docs table reads it) and
the config keys it reads. Config validation, the `gpudaemon.io/policy` annotation and
the docs all read the registry, so adding a policy is one new file plus its tests.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from gpudaemon.cluster.state import NodeState, PodShape
from gpudaemon.errors import ConfigError


class Policy(Protocol):
    """Orders feasible nodes for one pod.

    `raw_score` is pure: it reads the node, the pod and what the policy has learned,
    and changes nothing. Learning happens only in the two hooks, called outside
    scoring: `observe_pod` when a real pod arrives (the start of /filter), and
    `observe_node` when a node appears or changes (from the informer), with
    `forget_node` when it goes."""

    name: str
    # Whether a pod asking for no GPU gets real scores (it strands GPUs by taking the CPU
    # and memory next to them) or neutral ones.
    scores_gpuless_pods: bool

    def raw_score(self, node: NodeState, pod: PodShape) -> float:
        """Higher is better. Only the order between nodes matters."""
        ...

    def scores_version(self) -> object:
        """Changes whenever the same node state and pod may score differently (what the
        policy learned moved on): scores memoized under another version are dropped."""
        ...

    def observe_pod(self, uid: str, pod: PodShape) -> None: ...

    def observe_node(self, node: NodeState) -> None: ...

    def forget_node(self, name: str) -> None: ...


@dataclass(frozen=True)
class PolicySpec:
    name: str
    # Builds the policy from the `extender:` config section (ExtenderConfig).
    factory: Callable[[Any], Policy]
    summary: str
    config_keys: tuple[str, ...] = ()  # the `extender.*` keys it reads, for the docs


_REGISTRY: dict[str, PolicySpec] = {}
_LOCK = threading.Lock()


def register(spec: PolicySpec) -> PolicySpec:
    """Add a policy; a second one under the same name is a bug, refused at import."""
    with _LOCK:
        if spec.name in _REGISTRY and _REGISTRY[spec.name] is not spec:
            raise ValueError(f"policy {spec.name!r} is registered twice")
        _REGISTRY[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    """For tests that register a policy of their own."""
    with _LOCK:
        _REGISTRY.pop(name, None)


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


class FreeGpuPolicy:
    """The base of binpack and spread: they learn nothing (the score is a pure function
    of node and pod, so `scores_version` never moves), leave GPU-less pods neutral, and
    use measured utilization only to break ties."""

    scores_gpuless_pods = False

    def __init__(self, utilization_weight: float = 0.5) -> None:
        self.utilization_weight = utilization_weight  # < 1: a tie-break, never more

    def scores_version(self) -> object:
        return 0

    def observe_pod(self, uid: str, pod: PodShape) -> None:
        pass

    def observe_node(self, node: NodeState) -> None:
        pass

    def forget_node(self, name: str) -> None:
        pass


def utilization(node: NodeState) -> float:
    """Measured utilization in [0, 1]; unknown counts as idle."""
    u = node.utilization_ratio
    return 0.0 if u is None else min(1.0, max(0.0, u))
