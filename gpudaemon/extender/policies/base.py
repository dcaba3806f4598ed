"""The policy interface."""

from __future__ import annotations

from typing import Protocol

from gpudaemon.extender.state import NodeState, PodShape


class Policy(Protocol):
    """Orders feasible nodes for one pod. Must be pure: same inputs, same score."""

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


class FreeGpuPolicy:
    """The base of binpack and spread: they learn nothing (the score is a pure function
    of node and pod, so `scores_version` never moves), leave GPU-less pods neutral, and
    use measured utilization only to break ties."""

    scores_gpuless_pods = False

    def __init__(self, utilization_weight: float = 0.5) -> None:
        self.utilization_weight = utilization_weight  # < 1: a tie-break, never more

    def scores_version(self) -> object:
        return 0


def utilization(node: NodeState) -> float:
    """Measured utilization in [0, 1]; unknown counts as idle."""
    u = node.utilization_ratio
    return 0.0 if u is None else min(1.0, max(0.0, u))
