"""Whether a node can take a pod, one pure check per concern: the agent's data (read,
present, fresh), GPU health, and GPU capacity (whole GPUs and MIG devices).

The filter plug-ins (cluster/plugins/) are these checks by name; `check_node` runs them
in the default order.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpudaemon.cluster.state import NodeState, PodShape


@dataclass(frozen=True, slots=True)
class Rejection:
    """Why a node cannot take the pod: `reason` is a metric label, `message` one line."""

    reason: str
    message: str


NO_AGENT = Rejection("no_agent", "no gpudaemon agent data for this node")
STALE = Rejection("stale", "gpudaemon agent data is stale (Lease missing or expired)")


def agent_data(node: NodeState | None, fresh: bool) -> Rejection | None:
    """The agent's data is readable, present and fresh, in the order an operator fixes
    them: unreadable data first, then no agent, then a stale Lease."""
    if node is not None and node.bad_data:
        return Rejection("bad_data", f"gpudaemon agent data unreadable: {node.bad_data}")
    if node is None or not node.has_agent_labels:
        return NO_AGENT
    if not fresh:
        return STALE
    return None


def healthy(node: NodeState | None) -> Rejection | None:
    """No lost or failed GPU on the node: it will likely be drained and rebooted, and
    a pod landing there now would be killed with it."""
    if node is not None and node.gpus_unhealthy > 0:
        return Rejection(
            "unhealthy",
            f"{node.gpus_unhealthy} GPU(s) on the node unhealthy (lost, XID or ECC)",
        )
    return None


def gpu_fit(node: NodeState | None, pod: PodShape) -> Rejection | None:
    """Room for the pod's whole GPUs and MIG devices.

    Capacity by bound pods only: kube-scheduler's own filter, which ran first, counts
    its in-flight pods; our assumptions only steer the ranking (state.NodeState)."""
    if node is None:  # nothing known of its GPUs (agent_data names the cause)
        return NO_AGENT
    if pod.gpus > node.gpus_free_bound:
        return Rejection(
            "insufficient_gpus",
            f"pod needs {pod.gpus} GPU(s), {node.gpus_free_bound} healthy free"
            f" ({node.gpus_allocatable} allocatable,"
            f" {node.gpus_requested - node.gpus_assumed} requested)",
        )
    for profile, n in pod.mig:
        free = node.mig_free_bound.get(profile, 0)
        if n > free:
            alloc = dict(node.mig_allocatable).get(profile, 0)
            return Rejection(
                "insufficient_mig",
                f"pod needs {n} nvidia.com/mig-{profile}, {free} free"
                f" ({alloc} allocatable, {alloc - free} requested)",
            )
    return None


def check_node(
    node: NodeState | None, pod: PodShape, *, fresh: bool, avoid_unhealthy: bool = True
) -> Rejection | None:
    """None when the node can take the pod; otherwise why not: the checks in the
    extender's default filter order (the first failing one names the cause an operator
    should fix first)."""
    why = agent_data(node, fresh)
    if why is None and avoid_unhealthy:
        why = healthy(node)
    if why is None:
        why = gpu_fit(node, pod)
    return why
