"""Whether a pod may run on a node, by kube-scheduler's own filters, judged from the
watch caches only: pure functions of the Pod and Node objects, no API calls.

Evaluated: every resource request (NodeResourcesFit: cpu, memory, ephemeral-storage,
hugepages, extended resources, the pod count; init containers, sidecars, pod-level
resources and overhead by the scheduler's rule) against allocatable minus what the
node's pods request; nodeSelector and required node affinity (NodeAffinity); taints
with NoSchedule/NoExecute against tolerations (TaintToleration); a cordoned node
(NodeUnschedulable); the pod's nodeName (NodeName); and other pods' required
anti-affinity against this pod (InterPodAffinity, the existing pods' side).

What cannot be judged from these caches (the pod's own required pod affinity or
anti-affinity, topology spread with DoNotSchedule, resource claims, host ports,
volumes other than the node-local kinds, scheduling gates, a field this version does
not know) makes `PodFit.unjudgeable` say why: the rebalancer then evicts nothing for
that pod, and does not move it.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpudaemon.cluster.podspec import effective_requests, quantity

Taint = tuple[str, str, str]  # (key, value, effect)
UNSCHEDULABLE_TAINT: Taint = ("node.kubernetes.io/unschedulable", "", "NoSchedule")
HOSTNAME_LABEL = "kubernetes.io/hostname"

# Volumes that bind a pod to no node and that no scheduler filter counts.
NODE_LOCAL_VOLUMES = frozenset(
    {"emptyDir", "configMap", "secret", "downwardAPI", "projected", "hostPath", "image"}
)
# PodSpec fields (Kubernetes 1.34) known to change nothing this module does not judge,
# or judged here. A field not listed is a feature this version does not understand.
KNOWN_SPEC_FIELDS = frozenset(
    [
        "activeDeadlineSeconds",
        "affinity",
        "automountServiceAccountToken",
        "containers",
        "dnsConfig",
        "dnsPolicy",
        "enableServiceLinks",
        "ephemeralContainers",
        "hostAliases",
        "hostIPC",
        "hostNetwork",
        "hostPID",
        "hostUsers",
        "hostname",
        "hostnameOverride",
        "imagePullSecrets",
        "initContainers",
        "nodeName",
        "nodeSelector",
        "os",
        "overhead",
        "preemptionPolicy",
        "priority",
        "priorityClassName",
        "readinessGates",
        "resourceClaims",
        "resources",
        "restartPolicy",
        "runtimeClassName",
        "schedulerName",
        "schedulingGates",
        "securityContext",
        "serviceAccount",
        "serviceAccountName",
        "setHostnameAsFQDN",
        "shareProcessNamespace",
        "subdomain",
        "terminationGracePeriodSeconds",
        "tolerations",
        "topologySpreadConstraints",
        "volumes",
    ]
)
_NODE_OPS = frozenset({"In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"})
_LABEL_OPS = frozenset({"In", "NotIn", "Exists", "DoesNotExist"})


@dataclass(frozen=True)
class PodFit:
    """What the scheduler's filters read from one pod. Amounts are whole units: CPU in
    millicores, everything else rounded up (as Quantity.Value() does)."""

    requests: Mapping[str, int] = field(default_factory=dict)
    node_name: str = ""
    node_selector: Mapping[str, str] = field(default_factory=dict)
    # Required node affinity's terms (ORed); None when the pod has none.
    node_terms: tuple[Mapping[str, Any], ...] | None = None
    tolerations: tuple[Mapping[str, Any], ...] = ()
    namespace: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    # Its own required podAntiAffinity terms: they keep *other* pods off its domain.
    anti_affinity: tuple[Mapping[str, Any], ...] = ()
    unjudgeable: str = ""  # why the filters cannot be judged from the caches; "" if they can
    # The node-side placement inputs (not labels), to rank nodes once per kind of pod.
    signature: str = ""


@dataclass(frozen=True)
class NodeFit:
    """What the scheduler's filters read from one Node."""

    name: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    taints: tuple[Taint, ...] = ()  # NoSchedule and NoExecute only
    allocatable: Mapping[str, int] = field(default_factory=dict)
    unschedulable: bool = False


# -- parsing ------------------------------------------------------------------------


def amount(resource: str, value: object) -> int:
    """One quantity in the unit compared: millicores for cpu, else rounded-up units."""
    return units(resource, quantity(value))


def _add(a: Mapping[str, int], b: Mapping[str, int]) -> dict[str, int]:
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0) + v
    return out


def units(resource: str, v: float) -> int:
    """An effective request in the unit compared: millicores for cpu, else rounded-up
    units (resource.Quantity's MilliValue()/Value())."""
    return math.ceil(round(v * 1000, 6)) if resource == "cpu" else math.ceil(round(v, 6))


def pod_requests(spec: Mapping[str, Any]) -> dict[str, int]:
    """Every resource the pod asks for, by the one rule the extender uses too
    (cluster/podspec.effective_requests), plus one `pods`. Bad quantity -> ValueError."""
    reqs = {k: units(k, v) for k, v in effective_requests(spec).items()}
    return {k: v for k, v in _add(reqs, {"pods": 1}).items() if v > 0}


def _unjudgeable(spec: Mapping[str, Any]) -> str:
    unknown = sorted(str(k) for k in spec if k not in KNOWN_SPEC_FIELDS)
    if unknown:
        return f"it sets {', '.join(unknown)}, which this version does not judge"
    if spec.get("schedulingGates"):
        return "it has scheduling gates"
    if spec.get("resourceClaims"):
        return "it claims dynamic resources (resourceClaims)"
    affinity = spec.get("affinity") or {}
    extra = sorted(set(affinity) - {"nodeAffinity", "podAffinity", "podAntiAffinity"})
    if extra:
        return f"its affinity sets {', '.join(map(str, extra))}, which this version does not judge"
    for kind in ("podAffinity", "podAntiAffinity"):
        if (affinity.get(kind) or {}).get("requiredDuringSchedulingIgnoredDuringExecution"):
            return f"it has required {kind}, which depends on other pods' placement"
    for c in spec.get("topologySpreadConstraints") or []:
        if c.get("whenUnsatisfiable", "DoNotSchedule") == "DoNotSchedule":
            return "it has a topology spread constraint with whenUnsatisfiable: DoNotSchedule"
    for v in spec.get("volumes") or []:
        kinds = set(v) - {"name"}
        if not kinds <= NODE_LOCAL_VOLUMES:
            return f"its volume {v.get('name')!r} ({', '.join(sorted(kinds))}) may bind it to nodes"
    containers = [*(spec.get("containers") or []), *(spec.get("initContainers") or [])]
    for c in containers:
        for p in c.get("ports") or []:
            if p.get("hostPort") or spec.get("hostNetwork"):
                return "it uses host ports"
    required = ((affinity.get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution") or {})  # fmt: skip
    for term in required.get("nodeSelectorTerms") or []:
        for e in term.get("matchExpressions") or []:
            if e.get("operator") not in _NODE_OPS:
                return f"its node affinity uses operator {e.get('operator')!r}"
        for e in term.get("matchFields") or []:
            if e.get("key") != "metadata.name" or e.get("operator") not in ("In", "NotIn"):
                return f"its node affinity matches field {e.get('key')!r}"
    return ""


def pod_fit(obj: Mapping[str, Any]) -> PodFit:
    """The pod's filter inputs; ValueError when its resources cannot be read. A pod of
    unexpected shape (a list where a map belongs) is unjudgeable, not an exception."""
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    requests = pod_requests(spec)
    try:
        why = _unjudgeable(spec)
        affinity = spec.get("affinity") or {}
        required = ((affinity.get("nodeAffinity") or {}).get(
            "requiredDuringSchedulingIgnoredDuringExecution"))  # fmt: skip
        terms = None if required is None else tuple(required.get("nodeSelectorTerms") or ())
        anti = tuple(
            (affinity.get("podAntiAffinity") or {}).get(
                "requiredDuringSchedulingIgnoredDuringExecution") or ()
        )  # fmt: skip
        selector = {str(k): str(v) for k, v in (spec.get("nodeSelector") or {}).items()}
        tolerations = tuple(spec.get("tolerations") or ())
        labels = {str(k): str(v) for k, v in (meta.get("labels") or {}).items()}
    except (AttributeError, TypeError) as e:
        return PodFit(requests=requests, unjudgeable=f"its spec cannot be read ({e})")
    sig = json.dumps(
        [requests, selector, terms, tolerations, spec.get("nodeName") or ""],
        sort_keys=True,
        default=str,
    )
    return PodFit(
        requests=requests,
        node_name=str(spec.get("nodeName") or ""),
        node_selector=selector,
        node_terms=terms,
        tolerations=tolerations,
        namespace=str(meta.get("namespace") or ""),
        labels=labels,
        anti_affinity=anti,
        unjudgeable=why,
        signature=sig,
    )


def node_fit(obj: Mapping[str, Any]) -> NodeFit:
    """The Node's filter inputs. An allocatable amount that cannot be read counts as 0
    (the pod is then judged not to fit: no eviction on a guess)."""
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    alloc: dict[str, int] = {}
    for k, v in ((obj.get("status") or {}).get("allocatable") or {}).items():
        try:
            alloc[str(k)] = amount(str(k), v)
        except ValueError:
            alloc[str(k)] = 0
    taints = tuple(
        (str(t.get("key", "")), str(t.get("value", "")), str(t.get("effect", "")))
        for t in spec.get("taints") or []
        if isinstance(t, Mapping) and t.get("effect") in ("NoSchedule", "NoExecute")
    )
    return NodeFit(
        name=str(meta.get("name") or ""),
        labels={str(k): str(v) for k, v in (meta.get("labels") or {}).items()},
        taints=taints,
        allocatable=alloc,
        unschedulable=spec.get("unschedulable") is True,
    )


# -- the filters -----------------------------------------------------------------------


def tolerates(toleration: Mapping[str, Any], taint: Taint) -> bool:
    """core/v1 Toleration.ToleratesTaint, line by line."""
    key, value, effect = taint
    t_effect, t_key = toleration.get("effect") or "", toleration.get("key") or ""
    if t_effect and t_effect != effect:
        return False
    if t_key and t_key != key:
        return False
    op = toleration.get("operator") or "Equal"
    if op == "Equal":
        return str(toleration.get("value") or "") == value
    return op == "Exists"  # an operator this version does not know tolerates nothing


def untolerated(taints: Iterable[Taint], tolerations: Sequence[Mapping[str, Any]]) -> Taint | None:
    for taint in taints:
        if not any(tolerates(t, taint) for t in tolerations):
            return taint
    return None


def _expression(e: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    key, op = str(e.get("key") or ""), e.get("operator")
    values = [str(v) for v in e.get("values") or []]
    have = labels.get(key)
    if op == "In":
        return have is not None and have in values
    if op == "NotIn":
        return have is None or have not in values
    if op == "Exists":
        return have is not None
    if op == "DoesNotExist":
        return have is None
    if op in ("Gt", "Lt") and have is not None and len(values) == 1:
        a, b = go_int64(have), go_int64(values[0])
        if a is None or b is None:
            return False
        return a > b if op == "Gt" else a < b
    return False


_DECIMAL = re.compile(r"[+-]?[0-9]+")


def go_int64(text: str) -> int | None:
    """The number as Go's strconv.ParseInt(text, 10, 64) reads it (what Gt and Lt
    compare), None where it refuses: Python's int() also takes "1_0", spaces and
    non-ASCII digits, and has no int64 bound."""
    if not _DECIMAL.fullmatch(text):
        return None
    v = int(text)
    return v if -(2**63) <= v < 2**63 else None


def node_term_matches(term: Mapping[str, Any], node: NodeFit) -> bool:
    """One NodeSelectorTerm: its expressions ANDed; an empty term matches no node."""
    exprs = list(term.get("matchExpressions") or [])
    fields = list(term.get("matchFields") or [])
    if not exprs and not fields:
        return False
    if not all(_expression(e, node.labels) for e in exprs):
        return False
    return all(_expression(e, {"metadata.name": node.name}) for e in fields)


def label_selector_matches(sel: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """A metav1.LabelSelector: null matches nothing, empty matches everything. An
    operator this version does not know counts as a match (the cautious side)."""
    if sel is None:
        return False
    if any(labels.get(str(k)) != str(v) for k, v in (sel.get("matchLabels") or {}).items()):
        return False
    for e in sel.get("matchExpressions") or []:
        if e.get("operator") in _LABEL_OPS and not _expression(e, labels):
            return False
    return True


def static_reason(pod: PodFit, node: NodeFit) -> str:
    """Why the pod may not run on the node whatever it frees ("" when it may): the
    scheduler's NodeName, NodeUnschedulable, NodeAffinity and TaintToleration filters."""
    if pod.node_name and pod.node_name != node.name:
        return f"the pod names node {pod.node_name}"
    if node.unschedulable and untolerated([UNSCHEDULABLE_TAINT], pod.tolerations):
        return "the node is cordoned"
    for k, v in pod.node_selector.items():
        if node.labels.get(k) != v:
            return f"nodeSelector {k}={v} does not match"
    if pod.node_terms is not None and not any(node_term_matches(t, node) for t in pod.node_terms):
        return "required node affinity does not match"
    taint = untolerated(node.taints, pod.tolerations)
    if taint is not None:
        return f"taint {taint[0]}={taint[1]}:{taint[2]} is not tolerated"
    return ""


def insufficient(
    requests: Mapping[str, int], allocatable: Mapping[str, int], used: Mapping[str, int]
) -> list[str]:
    """The resources the pod asks for beyond what the node has left (NodeResourcesFit;
    a resource the node does not have at all has 0 left)."""
    return sorted(
        r for r, v in requests.items()
        if v > 0 and v > allocatable.get(r, 0) - used.get(r, 0)
    )  # fmt: skip


def used_by(pods: Iterable[PodFit]) -> dict[str, int]:
    total: dict[str, int] = {}
    for p in pods:
        for k, v in p.requests.items():
            total[k] = total.get(k, 0) + v
    return total


def excluded_domains(pod: PodFit, others: Iterable[tuple[PodFit, NodeFit]]) -> set[tuple[str, str]]:
    """(topology key, value) domains the pod may not enter because a pod there has a
    required anti-affinity term that selects it (InterPodAffinity, existing pods' side).
    A term with a namespaceSelector is taken to select it (cannot tell from pods alone)."""
    out: set[tuple[str, str]] = set()
    for other, where in others:
        for term in other.anti_affinity:
            key = str(term.get("topologyKey") or "")
            if not key or key not in where.labels:
                continue
            if term.get("namespaceSelector") is None:
                namespaces = term.get("namespaces") or [other.namespace]
                if pod.namespace not in namespaces:
                    continue
            if label_selector_matches(term.get("labelSelector"), pod.labels):
                out.add((key, where.labels[key]))
    return out


def in_domains(node: NodeFit, domains: set[tuple[str, str]]) -> bool:
    return any(node.labels.get(k) == v for k, v in domains)
