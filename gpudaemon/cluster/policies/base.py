"""The policy interface and a policy's description.

As in kube-scheduler's framework registry: a policy is one module under
`cluster/policies/` that defines its `SPEC = PolicySpec(...)`: its name, a factory
from the `extender:` config section, a one-line summary (the docs table reads it) and
the config keys it reads. `registry.py` lists every spec in one table; config
validation, the `gpudaemon.io/policy` annotation and the docs all read it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from gpudaemon.cluster.state import NodeState, PodShape


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
