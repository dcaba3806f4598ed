"""Filtering and score levels: pure functions of node states and the pod."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from gpudaemon.extender.state import NodeState, PodShape

MAX_SCORE = 10  # the extender API's MaxExtenderPriority


@dataclass(frozen=True, slots=True)
class Rejection:
    """Why a node cannot take the pod: `reason` is a metric label, `message` one line."""

    reason: str
    message: str


def check_node(
    node: NodeState | None, pod: PodShape, *, fresh: bool, avoid_unhealthy: bool = True
) -> Rejection | None:
    """None when the node can take the pod; otherwise why not.

    Order matters: the first failing rule names the cause an operator should fix first
    (no agent, then stale agent data, then GPU health, then capacity).
    """
    if node is None or not node.has_agent_labels:
        return Rejection("no_agent", "no gpudaemon agent data for this node")
    if not fresh:
        return Rejection("stale", "gpudaemon agent data is stale (Lease missing or expired)")
    if avoid_unhealthy and node.gpus_unhealthy > 0:
        return Rejection(
            "unhealthy",
            f"{node.gpus_unhealthy} GPU(s) on the node unhealthy (lost, XID or ECC)",
        )
    if pod.gpus > node.gpus_free:
        return Rejection(
            "insufficient_gpus",
            f"pod needs {pod.gpus} GPU(s), {node.gpus_free} healthy free"
            f" ({node.gpus_allocatable} allocatable, {node.gpus_requested} requested)",
        )
    return None


def to_levels(raw: Mapping[str, float]) -> dict[str, int]:
    """Map raw scores onto 0..10 by rank of distinct value, not linearly.

    A linear map squeezes the best nodes together when one outlier is far below them
    (11 levels, 5,000 nodes); by rank, the best ten distinct raw scores always get ten
    distinct levels (10, 9, ...) and everything else 0.
    """
    if not raw:
        return {}
    distinct = sorted(set(raw.values()), reverse=True)
    level = {v: max(0, MAX_SCORE - i) for i, v in enumerate(distinct[: MAX_SCORE + 1])}
    return {name: level.get(v, 0) for name, v in raw.items()}


def best(raw: Mapping[str, float], order: Iterable[str]) -> str | None:
    """The highest raw score; ties go to the first in `order` (the scheduler's order)."""
    top: str | None = None
    for name in order:
        if name in raw and (top is None or raw[name] > raw[top]):
            top = name
    return top
