"""`gpudaemon status`: where are the free, healthy GPUs? A fleet view read from the API
server only (Nodes, the agents' Leases, bound pods), so it runs anywhere a kubeconfig
does, with no agent on that machine.

The numbers are the extender's own: the nodes, pods and Leases go into the extender's
ClusterState, which applies the one pod-request rule (extender/podspec.py), the one
free-GPU rule (extender/state.py: allocatable - requested - unhealthy) and the one
freshness rule (an unexpired Lease owned by this Node object)."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC
from typing import Any

from gpudaemon.errors import BadValueError
from gpudaemon.extender.cluster import ClusterState
from gpudaemon.extender.metrics import node_gpus
from gpudaemon.extender.podspec import GPU_RESOURCE
from gpudaemon.kube.client import KubeClient
from gpudaemon.kube.lease import lease_path, parse_time
from gpudaemon.labels.annotations import decode_gpus

# The node-pool label of the common platforms, first match wins (`--pool-label` to name
# another): GKE, EKS managed node groups, AKS, Karpenter, OpenShift machine sets.
POOL_LABELS = (
    "cloud.google.com/gke-nodepool",
    "eks.amazonaws.com/nodegroup",
    "kubernetes.azure.com/agentpool",
    "karpenter.sh/nodepool",
    "machine.openshift.io/cluster-api-machineset",
)
TERMINAL = "status.phase!=Succeeded,status.phase!=Failed"


@dataclass
class Unhealthy:
    index: int
    reason: str


@dataclass
class NodeRow:
    name: str
    product: str
    total: int
    healthy: int
    allocated: int
    free: int
    fresh: bool
    age_s: float | None  # seconds since the agent's last Lease renewal; None: no Lease
    unhealthy: list[Unhealthy] = field(default_factory=list)
    pool: str = ""
    # Why the agent's labels or annotation could not be read ("" when they could): the
    # node then has no data, so it is not fresh (issue 28).
    bad_data: str = ""


@dataclass
class SummaryRow:
    product: str
    pool: str
    nodes: int = 0
    stale_nodes: int = 0
    total: int = 0
    healthy: int = 0
    allocated: int = 0
    free: int = 0


def collect(
    client: KubeClient,
    *,
    prefix: str,
    lease_namespace: str,
    selector: str = "",
    pool_label: str = "",
    now: float | None = None,
) -> list[NodeRow]:
    """One row per GPU node (the agent labelled it, or it has nvidia.com/gpu)."""
    query = {"labelSelector": selector} if selector else None
    nodes, _ = client.list_items("/api/v1/nodes", query)
    gpu_nodes = [n for n in nodes if _is_gpu_node(n, prefix)]
    leases, _ = client.list_items(lease_path(lease_namespace))
    wall = now if now is not None else time.time()
    cluster = ClusterState(prefix, wall=lambda: wall)
    cluster.replace_nodes(gpu_nodes)
    cluster.replace_leases(leases)
    # Page by page into the usage counts: a big cluster's pods are never all in memory.
    query = {"fieldSelector": f"spec.nodeName!=,{TERMINAL}"}
    for page, _ in client.pages("/api/v1/pods", query):
        for pod in page:
            cluster.pod_event("ADDED", pod)
    names = [str(n["metadata"]["name"]) for n in gpu_nodes]
    snap = cluster.snapshot(names)
    renewed = {str((le.get("metadata") or {}).get("name", "")): _renewed(le) for le in leases}
    rows = []
    for node, name in zip(gpu_nodes, names, strict=True):
        st = snap.states[name]
        assert st is not None
        labels = (node.get("metadata") or {}).get("labels") or {}
        total, healthy = node_gpus(st)
        at = renewed.get(name)
        rows.append(
            NodeRow(
                name=name,
                product=st.gpu_model,
                total=total,
                healthy=healthy,
                allocated=st.gpus_requested,
                free=st.gpus_free,
                fresh=snap.fresh[name],
                age_s=None if at is None else round(max(0.0, wall - at), 1),
                unhealthy=_unhealthy(node, prefix),
                pool=_pool(labels, pool_label),
                bad_data=cluster.bad_reason(name),
            )
        )
    return sorted(rows, key=lambda r: r.name)


def summarize(rows: Sequence[NodeRow]) -> list[SummaryRow]:
    out: dict[tuple[str, str], SummaryRow] = {}
    for r in rows:
        s = out.setdefault((r.product, r.pool), SummaryRow(r.product, r.pool))
        s.nodes += 1
        s.stale_nodes += not r.fresh
        s.total += r.total
        s.healthy += r.healthy
        s.allocated += r.allocated
        s.free += r.free if r.fresh else 0  # a stale node's GPUs are not on offer
    return [out[k] for k in sorted(out)]


def as_json(rows: Sequence[NodeRow]) -> str:
    nodes = []
    for r in rows:
        d = asdict(r)
        d.pop("pool")
        nodes.append(d)
    return json.dumps({"nodes": nodes, "summary": [asdict(s) for s in summarize(rows)]}, indent=2)


def as_table(rows: Sequence[NodeRow]) -> str:
    head = ("NODE", "PRODUCT", "TOTAL", "HEALTHY", "ALLOCATED", "FREE", "FRESH", "AGE", "UNHEALTHY")
    body = [
        (
            r.name,
            r.product or "-",
            str(r.total),
            str(r.healthy),
            str(r.allocated),
            str(r.free),
            "yes" if r.fresh else "NO",
            "-" if r.age_s is None else _age(r.age_s),
            (f"agent data unreadable: {r.bad_data}" if r.bad_data else "")
            or ", ".join(f"{u.index}: {u.reason}" for u in r.unhealthy)
            or "-",
        )
        for r in rows
    ]
    sums = summarize(rows)
    head2 = ("PRODUCT", "POOL", "NODES", "STALE", "TOTAL", "HEALTHY", "ALLOCATED", "FREE")
    body2 = [
        (s.product or "-", s.pool or "-", *(str(v) for v in (
            s.nodes, s.stale_nodes, s.total, s.healthy, s.allocated, s.free)))
        for s in sums
    ]  # fmt: skip
    note = "FREE in the summary counts fresh nodes only: a stale node's GPUs are not offered."
    return f"{_grid(head, body)}\n\n{_grid(head2, body2)}\n{note}\n"


def _grid(head: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in (head, *body)) for i in range(len(head))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        for r in (head, *body)
    )


def _age(s: float) -> str:
    if s < 120:
        return f"{s:.0f}s"
    if s < 7200:
        return f"{s / 60:.0f}m"
    return f"{s / 3600:.0f}h"


def _is_gpu_node(node: Mapping[str, Any], prefix: str) -> bool:
    meta = node.get("metadata") or {}
    if (prefix + "gpu.count") in (meta.get("labels") or {}):
        return True
    alloc = (node.get("status") or {}).get("allocatable") or {}
    return str(alloc.get(GPU_RESOURCE, "0")) not in ("0", "")


def _unhealthy(node: Mapping[str, Any], prefix: str) -> list[Unhealthy]:
    text = ((node.get("metadata") or {}).get("annotations") or {}).get(prefix + "gpus")
    if not isinstance(text, str):
        return []
    try:
        gpus = decode_gpus(text)
    except BadValueError:  # the node is shown with `bad_data` instead
        return []
    return [Unhealthy(g.index, g.reason or "unhealthy") for g in gpus if not g.healthy]


def _renewed(lease: Mapping[str, Any]) -> float | None:
    t = parse_time((lease.get("spec") or {}).get("renewTime"))
    try:
        return None if t is None else t.astimezone(UTC).timestamp()
    except (OverflowError, ValueError):  # year 1 at +14:00: not a time it renewed at
        return None


def _pool(labels: Mapping[str, Any], pool_label: str) -> str:
    for key in (pool_label,) if pool_label else POOL_LABELS:
        if key in labels:
            return str(labels[key])
    return ""
