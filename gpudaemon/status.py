"""`gpudaemon status`: where are the free, healthy GPUs? A fleet view read from the API
server only (Nodes, the agents' Leases, bound pods), so it runs anywhere a kubeconfig
does, with no agent on that machine.

The numbers are the extender's own: the nodes, pods and Leases go into the extender's
ClusterState, which applies the one pod-request rule (cluster/podspec.py), the one
free-GPU rule (cluster/state.py: allocatable - requested - unhealthy) and the one
freshness rule (an unexpired Lease owned by this Node object). A node whose data is not
fresh shows its healthy and free GPUs as unknown (None), never as a guess, and says why.

On a DRA cluster (any ResourceSlice) the DRA objects go into the same ClusterState,
so a node's GPUs published by NVIDIA's DRA driver and the devices allocated to claims
count as the extender counts them.

The agents' Leases are where the chart put them: `-n` names that namespace; without it,
the Leases are found by their label (`NODE_LEASE_SELECTOR`) in every namespace with one
list the API server filters, and only when none is found (agents older than the label,
or no right to list Leases across namespaces) in `kubernetes.lease_namespace`.

Each unhealthy or degraded GPU is listed with the agent's verdict (health/verdict.py):
its state, the action it needs and why (issue 30); an agent older than the verdict
gives no action ("")."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC
from typing import Any

from gpudaemon.cluster.clusterstate import ClusterState
from gpudaemon.cluster.drawatch import DRA_PATH
from gpudaemon.cluster.metrics import DRA_KINDS, node_gpus
from gpudaemon.cluster.podspec import GPU_RESOURCE
from gpudaemon.errors import BadValueError, KubeForbiddenError, KubeNotFoundError
from gpudaemon.kube.client import NODE_LEASE_SELECTOR, KubeClient
from gpudaemon.kube.lease import LEASE_API, lease_expiry, lease_path, parse_time
from gpudaemon.labels.annotations import decode_gpus
from gpudaemon.labels.keys import GPU_COUNT, GPUS_ANNOTATION

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
    """A GPU that is not healthy, as the agent's `gpus` annotation has it."""

    index: int
    reason: str
    state: str = "unhealthy"  # unhealthy | degraded
    action: str = ""  # none | watch | drain | reset_gpu | reboot_node | replace; "": unknown


@dataclass
class NodeRow:
    name: str
    product: str
    total: int
    healthy: int | None  # None: no fresh data (`stale_reason` says why)
    allocated: int
    free: int | None  # None: no fresh data
    fresh: bool
    age_s: float | None  # seconds since the agent's last Lease renewal; None: no Lease
    unhealthy: list[Unhealthy] | None = field(default_factory=list)  # None: no fresh data
    # Schedulable but watched (clock events, growing remaps, NVLink errors); None: no data.
    degraded: list[Unhealthy] | None = field(default_factory=list)
    pool: str = ""
    # Why the agent's labels or annotation could not be read ("" when they could): the
    # node then has no data, so it is not fresh (issue 28).
    bad_data: str = ""
    stale_reason: str | None = None  # None when fresh
    # Why no pod can be placed on the node at all ("" when one can): cordoned, or its
    # kubelet NotReady. Its FREE is then 0, whatever its GPUs are.
    unavailable: str = ""


@dataclass(frozen=True)
class Leases:
    """The agents' node Leases by node name, and where they were looked for."""

    by_node: dict[str, dict[str, Any]]
    where: str  # "namespace gpudaemon", "namespaces a, b", for the stale reasons


@dataclass
class SummaryRow:
    product: str
    pool: str
    nodes: int = 0
    stale_nodes: int = 0
    total: int = 0
    healthy: int = 0
    degraded: int = 0  # of the healthy (schedulable) ones
    allocated: int = 0
    free: int = 0


def find_leases(client: KubeClient, namespace: str | None, fallback: str) -> Leases:
    """The node Leases in `namespace`; None: those carrying the agents' label in any
    namespace, else (none, or listing across namespaces is not allowed) `fallback`'s."""
    if namespace is None:
        try:
            items, _ = client.list_items(
                f"{LEASE_API}/leases", {"labelSelector": NODE_LEASE_SELECTOR}
            )
        except (KubeForbiddenError, KubeNotFoundError):
            items = []
        if items:
            spaces = sorted({str((i.get("metadata") or {}).get("namespace", "")) for i in items})
            return Leases(_latest_by_name(items), "namespaces " + ", ".join(spaces))
        namespace = fallback
    try:
        items, _ = client.list_items(lease_path(namespace))
    except KubeNotFoundError:
        items = []
    return Leases(_latest_by_name(items), f"namespace {namespace}")


def _latest_by_name(leases: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """One Lease per node: with two releases' agents on one node, the later renewal."""
    out: dict[str, dict[str, Any]] = {}
    for le in leases:
        name = str((le.get("metadata") or {}).get("name", ""))
        if name not in out or (_renewed(le) or 0.0) > (_renewed(out[name]) or 0.0):
            out[name] = le
    return out


def collect(
    client: KubeClient,
    *,
    prefix: str,
    lease_namespace: str | None,
    fallback_namespace: str = "gpudaemon",
    selector: str = "",
    pool_label: str = "",
    now: float | None = None,
) -> list[NodeRow]:
    """One row per GPU node (the agent labelled it, or it has nvidia.com/gpu).
    `lease_namespace` None: find the agents' Leases (see `find_leases`)."""
    query = {"labelSelector": selector} if selector else None
    nodes, _ = client.list_items("/api/v1/nodes", query)
    gpu_nodes = [n for n in nodes if _is_gpu_node(n, prefix)]
    found = find_leases(client, lease_namespace, fallback_namespace)
    leases = list(found.by_node.values())
    wall = now if now is not None else time.time()
    slices = _list_all(client, DRA_PATH + "resourceslices")
    cluster = ClusterState(prefix, wall=lambda: wall, dra=bool(slices))
    cluster.replace_nodes(gpu_nodes)
    cluster.replace_leases(leases)
    if slices:  # a DRA cluster: its GPUs and claims counted as the extender counts them
        cluster.dra_replace("resourceslices")(slices)
        for kind in DRA_KINDS:
            if kind != "resourceslices":
                cluster.dra_replace(kind)(_list_all(client, DRA_PATH + kind))
    # Page by page into the usage counts: a big cluster's pods are never all in memory.
    query = {"fieldSelector": f"spec.nodeName!=,{TERMINAL}"}
    for page, _ in client.pages("/api/v1/pods", query):
        for pod in page:
            cluster.pod_event("ADDED", pod)
    names = [str(n["metadata"]["name"]) for n in gpu_nodes]
    snap = cluster.snapshot(names)
    rows = []
    for node, name in zip(gpu_nodes, names, strict=True):
        st = snap.states[name]
        assert st is not None
        labels = (node.get("metadata") or {}).get("labels") or {}
        total, healthy = node_gpus(st)
        lease = found.by_node.get(name)
        at = None if lease is None else _renewed(lease)
        sick, ann_problem = _not_healthy(node, prefix)
        bad = cluster.bad_reason(name)
        why = None
        if bad:
            why = f"agent data unreadable: {bad}"
        elif not snap.fresh[name]:
            why = _lease_problem(node, lease, found.where, wall)
        elif ann_problem:
            why = ann_problem
        closed = _unavailable(node)
        free = None if why else st.gpus_free
        rows.append(
            NodeRow(
                name=name,
                product=st.gpu_model,
                total=total,
                healthy=None if why else healthy,
                allocated=st.gpus_requested,
                free=0 if closed else free,
                fresh=why is None,
                age_s=None if at is None else round(max(0.0, wall - at), 1),
                unhealthy=None if why else [u for u in sick if u.state == "unhealthy"],
                degraded=None if why else [u for u in sick if u.state != "unhealthy"],
                pool=_pool(labels, pool_label),
                bad_data=bad,
                stale_reason=why,
                unavailable=closed,
            )
        )
    return sorted(rows, key=lambda r: r.name)


def _list_all(client: KubeClient, path: str) -> list[dict[str, Any]]:
    """Every object of a DRA kind, page by page; none where the API server does not
    serve it (before 1.34, or DeviceTaintRule before 1.37) or this user may not read
    it: `status` then counts as the extender does without DRA."""
    try:
        return [o for page, _ in client.pages(path) for o in page]
    except (KubeNotFoundError, KubeForbiddenError):
        return []


def _unavailable(node: Mapping[str, Any]) -> str:
    """Why the scheduler places nothing on the node ("" when it may): cordoned
    (spec.unschedulable), or Ready not True (its kubelet is down or unreachable; a
    Node with no Ready condition yet is not judged)."""
    if (node.get("spec") or {}).get("unschedulable") is True:
        return "cordoned"
    conditions = (node.get("status") or {}).get("conditions") or []
    ready = next(
        (c for c in conditions if isinstance(c, Mapping) and c.get("type") == "Ready"), None
    )
    if ready is not None and ready.get("status") != "True":
        reason = str(ready.get("reason") or ready.get("status") or "")[:80]
        return f"NotReady ({reason})" if reason else "NotReady"
    return ""


def _lease_problem(
    node: Mapping[str, Any], lease: Mapping[str, Any] | None, where: str, wall: float
) -> str:
    """Why the Lease does not vouch for the node, in the words an operator acts on."""
    if lease is None:
        return f"no agent Lease in {where}"
    expiry = lease_expiry(lease)
    if expiry is None:
        return "the Lease has no valid renewTime or leaseDurationSeconds"
    uid = str((node.get("metadata") or {}).get("uid", ""))
    owners = (lease.get("metadata") or {}).get("ownerReferences") or []
    owner = next((str(o.get("uid", "")) for o in owners if isinstance(o, dict)
                  and o.get("kind") == "Node"), "")  # fmt: skip
    if owner and uid and owner != uid:
        return "the Lease belongs to an earlier Node of this name"
    ago = _age(max(0.0, wall - expiry.timestamp()))
    if (lease.get("spec") or {}).get("holderIdentity") == "":
        return f"the agent stopped (released its Lease) {ago} ago"
    return f"the Lease expired {ago} ago"


def summarize(rows: Sequence[NodeRow]) -> list[SummaryRow]:
    out: dict[tuple[str, str], SummaryRow] = {}
    for r in rows:
        s = out.setdefault((r.product, r.pool), SummaryRow(r.product, r.pool))
        s.nodes += 1
        s.stale_nodes += not r.fresh
        s.total += r.total
        s.healthy += r.healthy or 0  # a stale node's GPUs are not known to be healthy
        s.degraded += len(r.degraded or ())
        s.allocated += r.allocated
        s.free += r.free or 0  # nor on offer
    return [out[k] for k in sorted(out)]


def as_json(rows: Sequence[NodeRow]) -> str:
    nodes = []
    for r in rows:
        d = asdict(r)
        d.pop("pool")
        nodes.append(d)
    return json.dumps({"nodes": nodes, "summary": [asdict(s) for s in summarize(rows)]}, indent=2)


def as_table(rows: Sequence[NodeRow]) -> str:
    head = (
        "NODE", "PRODUCT", "TOTAL", "HEALTHY", "ALLOCATED", "FREE", "FRESH", "AGE", "GPU-HEALTH",
        "DETAIL",
    )  # fmt: skip
    body = [
        (
            r.name,
            r.product or "-",
            str(r.total),
            _opt(r.healthy),
            str(r.allocated),
            _opt(r.free),
            "yes" if r.fresh else "NO",
            "-" if r.age_s is None else _age(r.age_s),
            ",".join(_verdict(u) for u in _attention(r)) or "-",
            _detail(r),
        )
        for r in rows
    ]
    sums = summarize(rows)
    head2 = (
        "PRODUCT", "POOL", "NODES", "STALE", "TOTAL", "HEALTHY", "DEGRADED", "ALLOCATED", "FREE",
    )  # fmt: skip
    body2 = [
        (s.product or "-", s.pool or "-", *(str(v) for v in (
            s.nodes, s.stale_nodes, s.total, s.healthy, s.degraded, s.allocated, s.free)))
        for s in sums
    ]  # fmt: skip
    note = (
        "HEALTHY and FREE are '-' (unknown) on a stale node, and the summary counts fresh "
        "nodes only: a stale node's GPUs are not offered. FREE is 0 on a cordoned or "
        "NotReady node (DETAIL says which). GPU-HEALTH: index=state/action of each GPU not "
        "healthy (degraded ones are schedulable and counted as healthy)."
    )
    return f"{_grid(head, body)}\n\n{_grid(head2, body2)}\n{note}\n"


def _detail(r: NodeRow) -> str:
    parts = [f"{r.unavailable}: 0 free"] if r.unavailable else []
    if r.stale_reason:
        parts.append(f"stale: {r.stale_reason}")
    else:
        parts += [f"{u.index}: {u.reason}" for u in _attention(r)]
    return ", ".join(parts) or "-"


def _attention(r: NodeRow) -> list[Unhealthy]:
    """The node's unhealthy and degraded GPUs, by index."""
    return sorted([*(r.unhealthy or ()), *(r.degraded or ())], key=lambda u: u.index)


def _verdict(u: Unhealthy) -> str:
    """`5=unhealthy/reboot_node`; `5=unhealthy` from an agent older than the action."""
    return f"{u.index}={u.state}" + (f"/{u.action}" if u.action else "")


def _grid(head: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in (head, *body)) for i in range(len(head))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        for r in (head, *body)
    )


def _opt(v: int | None) -> str:
    return "-" if v is None else str(v)


def _age(s: float) -> str:
    if s < 120:
        return f"{s:.0f}s"
    if s < 7200:
        return f"{s / 60:.0f}m"
    return f"{s / 3600:.0f}h"


def _is_gpu_node(node: Mapping[str, Any], prefix: str) -> bool:
    meta = node.get("metadata") or {}
    if (prefix + GPU_COUNT) in (meta.get("labels") or {}):
        return True
    alloc = (node.get("status") or {}).get("allocatable") or {}
    return str(alloc.get(GPU_RESOURCE, "0")) not in ("0", "")


def _not_healthy(node: Mapping[str, Any], prefix: str) -> tuple[list[Unhealthy], str]:
    """The unhealthy and degraded GPUs the agent's `gpus` annotation names, and what is
    wrong with the annotation ("" when nothing): a node without a readable one has no
    GPU data."""
    meta = node.get("metadata") or {}
    if prefix + GPU_COUNT not in (meta.get("labels") or {}):
        return [], f"no agent labels ({prefix}{GPU_COUNT})"
    text = (meta.get("annotations") or {}).get(prefix + GPUS_ANNOTATION)
    if not isinstance(text, str):
        return [], f"no {prefix}{GPUS_ANNOTATION} annotation"
    try:
        gpus = decode_gpus(text)
    except BadValueError:  # the node is shown as "agent data unreadable" instead
        return [], f"unreadable {prefix}{GPUS_ANNOTATION} annotation"
    return [
        Unhealthy(g.index, g.reason or g.state, g.state, g.action)
        for g in gpus
        if g.state != "healthy"
    ], ""


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
