"""Filtering and score levels: pure functions of node states and the pod."""

from __future__ import annotations

from collections.abc import Mapping
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


def best(raw: Mapping[str, float]) -> str | None:
    """The pick: the highest raw score, ties broken by node name, so the extender
    and every replica of it agree on one node."""
    return min(raw, key=lambda n: (-raw[n], n)) if raw else None


def to_levels(raw: Mapping[str, float]) -> dict[str, int]:
    """Map raw scores onto 0..10 by rank, not linearly, with the pick alone on top.

    Tiers: the pick (`best`), then the nodes that tie with it, then each lower distinct
    raw score; tier i gets level 10 - i, and tiers past the tenth get 0. A linear map
    would squeeze the best nodes together when one node is far worse (11 levels,
    5,000 nodes). The pick alone at 10 makes the scheduler's choice (the top total
    score; random among ties) the node the extender assumes the pod on, as long as the
    in-tree scores do not differ; equally good nodes stay one level below, so in-tree
    preferences can still choose among them.
    """
    top = best(raw)
    if top is None:
        return {}
    distinct = sorted(set(raw.values()), reverse=True)
    tier = {v: i + 1 for i, v in enumerate(distinct)}  # the top value's tier is 1
    if not any(v == raw[top] for n, v in raw.items() if n != top):
        tier = {v: t - 1 for v, t in tier.items()}  # no ties with the pick: no gap
    levels = {n: max(0, MAX_SCORE - tier[v]) for n, v in raw.items()}
    levels[top] = MAX_SCORE
    return levels
