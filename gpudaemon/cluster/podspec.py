"""A pod's effective requests, by the same rule kube-scheduler uses.

effective = max(sum(app containers) + sum(restartable init "sidecars"),
                max over init containers of (its request + sidecars started before it)),
            with pod-level spec.resources replacing CPU, memory and hugepages,
            + pod overhead

Only `requests` count (a limit with no request defaults the request to the limit, as
the API server does, so both are read).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from gpudaemon.cluster.state import PodShape

GPU_RESOURCE = "nvidia.com/gpu"
# The device plugin's mixed MIG strategy: one resource per profile, nvidia.com/mig-<p>.
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"
POLICY_ANNOTATION = "gpudaemon.io/policy"
# scheduler-plugins' Coscheduling: pods with this label form a gang (a PodGroup).
GANG_LABEL = "scheduling.x-k8s.io/pod-group"

_QUANTITY = re.compile(r"^([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)([a-zA-Z]*)$")
_SUFFIX: dict[str, float] = {
    "": 1,
    "n": 1e-9,
    "u": 1e-6,
    "m": 1e-3,
    "k": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "P": 1e15,
    "E": 1e18,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
}


def quantity(value: object) -> float:
    """A Kubernetes resource quantity ("500m", "16Gi", 2) as a float; bad -> ValueError."""
    if isinstance(value, bool):
        raise ValueError(f"bad quantity {value!r}")
    if isinstance(value, int | float):
        if not math.isfinite(value):
            raise ValueError(f"bad quantity {value!r}")
        return float(value)
    if not isinstance(value, str):
        raise ValueError(f"bad quantity {value!r}")
    m = _QUANTITY.match(value.strip())
    if not m or m.group(2) not in _SUFFIX:
        raise ValueError(f"bad quantity {value!r}")
    v = float(m.group(1)) * _SUFFIX[m.group(2)]
    if not math.isfinite(v):  # "1e400": no resource is infinite, and ceil() would raise
        raise ValueError(f"bad quantity {value!r}")
    return v


Resources = dict[str, float]


def requests_of(res: object) -> Resources:
    """A container's (or the pod's own) requests, every resource: a limit alone is the
    request, as the API server defaults it. Bad quantity -> ValueError."""
    if not isinstance(res, Mapping):
        return {}
    out: Resources = {}
    for where in (res.get("limits"), res.get("requests")):  # requests win: read last
        if isinstance(where, Mapping):
            for name, v in where.items():
                out[str(name)] = quantity(v)
    return out


def is_pod_level_resource(name: str) -> bool:
    """What pod-level `spec.resources` may set, and so replaces the containers' sum:
    CPU, memory and hugepages (the API server refuses any other)."""
    return name in ("cpu", "memory") or name.startswith("hugepages-")


def _add(a: Resources, b: Mapping[str, float]) -> Resources:
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0.0) + v
    return out


def _max(a: Resources, b: Mapping[str, float]) -> Resources:
    out = dict(a)
    for k, v in b.items():
        out[k] = max(out.get(k, 0.0), v)
    return out


def effective_requests(spec: Mapping[str, Any]) -> Resources:
    """Every resource a pod asks for, by kube-scheduler's rule (resource.PodRequests):
    the containers' sum with the sidecars, or an init container's peak if higher;
    pod-level `spec.resources` replacing what it sets (CPU, memory, hugepages); plus the
    overhead. In base units (cores, bytes, devices), unrounded. The one rule: the
    extender's pod shape (`pod_requests`) and the rebalancer's fit (rebalancer/fits.py)
    both read it."""
    total: Resources = {}
    for c in spec.get("containers") or []:
        total = _add(total, requests_of(c.get("resources")))
    sidecars: Resources = {}
    init_peak: Resources = {}
    for c in spec.get("initContainers") or []:
        req = requests_of(c.get("resources"))
        if c.get("restartPolicy") == "Always":  # a sidecar: runs beside what follows
            sidecars = _add(sidecars, req)
            init_peak = _max(init_peak, sidecars)
        else:
            init_peak = _max(init_peak, _add(req, sidecars))
    total = _max(_add(total, sidecars), init_peak)
    pod_level = requests_of(spec.get("resources"))
    total.update({k: v for k, v in pod_level.items() if is_pod_level_resource(k)})
    overhead = {str(k): quantity(v) for k, v in (spec.get("overhead") or {}).items()}
    return _add(total, overhead)


def pod_requests(pod: Mapping[str, Any]) -> Resources:
    """The pod's effective requests (`effective_requests` of its spec)."""
    return effective_requests(pod.get("spec") or {})


def gpu_models(pod: Mapping[str, Any], product_label: str) -> frozenset[str] | None:
    """GPU products allowed by the pod's required node affinity (`In` on the product
    label); None when unconstrained. Several terms are ORed, as the scheduler does."""
    spec = pod.get("spec") or {}
    selector = (spec.get("nodeSelector") or {}).get(product_label)
    models: set[str] | None = {selector} if isinstance(selector, str) else None
    req = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    terms = req.get("nodeSelectorTerms") or []
    allowed: set[str] = set()
    constrained_terms = 0
    for term in terms:
        for expr in term.get("matchExpressions") or []:
            if expr.get("key") == product_label and expr.get("operator") == "In":
                allowed |= {str(v) for v in expr.get("values") or []}
                constrained_terms += 1
                break
    if terms and constrained_terms == len(terms):  # every ORed term pins the product
        models = allowed if models is None else models & allowed
    return None if models is None else frozenset(models)


def pod_shape(pod: Mapping[str, Any], product_label: str) -> PodShape:
    req = pod_requests(pod)
    mig = tuple(
        sorted(
            (name.removeprefix(MIG_RESOURCE_PREFIX), math.ceil(v))
            for name, v in req.items()
            if name.startswith(MIG_RESOURCE_PREFIX) and v > 0
        )
    )
    return PodShape(
        # Rounded up, as resource.Quantity's MilliValue()/Value() do.
        gpus=math.ceil(req.get(GPU_RESOURCE, 0)),
        mig=mig,
        cpu_milli=math.ceil(round(req.get("cpu", 0) * 1000, 6)),
        memory_bytes=math.ceil(req.get("memory", 0)),
        gpu_models=gpu_models(pod, product_label),
    )


def native_pod_group(pod: Mapping[str, Any]) -> str:
    """The PodGroup the pod names in spec.schedulingGroup (Kubernetes' own gang
    scheduling), "" for none. kube-scheduler places such a gang in one group cycle, so
    its pods do not wait unbound at Permit as Coscheduling's do."""
    ref = (pod.get("spec") or {}).get("schedulingGroup")
    name = ref.get("podGroupName") if isinstance(ref, Mapping) else None
    return name if isinstance(name, str) else ""


def pod_gang(pod: Mapping[str, Any]) -> str:
    """`namespace/podgroup` of the pod's gang, "" when it is in none.

    Kubernetes' own gang scheduling (the Workload API, GenericWorkload: beta in 1.37)
    names the pod's PodGroup in `spec.schedulingGroup.podGroupName`; scheduler-plugins'
    Coscheduling names its PodGroup in a label. The native reference wins: it is what
    kube-scheduler's GangScheduling plug-in holds the pod to. Either way the key is
    the same shape, so the extender and the rebalancer need not know which it is."""
    meta = pod.get("metadata") or {}
    ns = meta.get("namespace") or ""
    native = native_pod_group(pod)
    if native:
        return f"{ns}/{native}"
    group = (meta.get("labels") or {}).get(GANG_LABEL)
    if not isinstance(group, str) or not group:
        return ""
    return f"{ns}/{group}"


def pod_priority(pod: Mapping[str, Any]) -> int:
    """spec.priority (the admission controller writes it from the PriorityClass), 0 if
    unset or not a whole number."""
    v = (pod.get("spec") or {}).get("priority")
    return v if isinstance(v, int) and not isinstance(v, bool) else 0


MAX_POLICY_NAME = 63  # policy names are short; the annotation may hold 256 KiB


def pod_policy(pod: Mapping[str, Any]) -> str | None:
    """The pod's policy annotation. A tenant writes it, and an unknown name is quoted
    back for every node in the filter's answer, so a longer value is cut (and so
    names no policy) rather than echoed 5,000 times."""
    ann = (pod.get("metadata") or {}).get("annotations") or {}
    v = ann.get(POLICY_ANNOTATION)
    if not isinstance(v, str):
        return None
    return v if len(v) <= MAX_POLICY_NAME else v[:MAX_POLICY_NAME] + "..."


# -- the kept form ------------------------------------------------------------------

# A pod's own annotations are ours to read only under this prefix (the policy, the
# rebalancer's opt-in); a value longer than this is cut (pod_policy cuts at 63 anyway).
OUR_ANNOTATION_PREFIX = "gpudaemon.io/"
MAX_KEPT_ANNOTATION = 256
_KEPT_META = ("name", "namespace", "uid", "labels", "ownerReferences", "deletionTimestamp",
              "creationTimestamp", "resourceVersion")  # fmt: skip
_KEPT_CONTAINER = ("name", "resources", "restartPolicy")
_KEPT_CONDITION = ("type", "status", "reason", "lastTransitionTime")
# The spec fields some reader reads the value of (podspec, fits.py, the gang and DRA
# readers). Any other field the pod sets is kept by name only (None): fits.py judges
# which fields are set, not what they hold (hostAliases, readinessGates and the like
# would otherwise be kept whole).
_READ_SPEC = frozenset({
    "affinity", "hostNetwork", "nodeName", "nodeSelector", "overhead", "priority",
    "resourceClaims", "resources", "schedulerName", "schedulingGates", "schedulingGroup",
    "tolerations", "topologySpreadConstraints",
})  # fmt: skip


def kept_pod(obj: Any) -> Any:
    """What the extender, the rebalancer and `status` read of a pod, and nothing else:
    the Reflector keeps each pod in this form from the moment its list page or watch
    event arrives, so memory follows what we keep, not what tenants write (env, command
    lines, managedFields, container statuses, other tools' annotations, spec fields
    nobody reads). What the scheduler's filters read (labels, affinity, tolerations,
    selectors, spread, claims) stays as written, so those still grow with what a
    tenant writes there; a volume keeps its name and kind (fits.py judges the kind)."""
    if not isinstance(obj, Mapping):
        return obj  # not a pod: the parsers that follow refuse it
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    status = obj.get("status") or {}
    if not isinstance(meta, Mapping) or not isinstance(spec, Mapping):
        return dict(obj)  # malformed: the parsers that follow reject it as before
    kept_meta = {k: meta[k] for k in _KEPT_META if k in meta}
    ann = meta.get("annotations")
    if isinstance(ann, Mapping):
        kept_meta["annotations"] = {
            k: v[:MAX_KEPT_ANNOTATION] if isinstance(v, str) else v
            for k, v in ann.items()
            if isinstance(k, str) and k.startswith(OUR_ANNOTATION_PREFIX)
        }
    kept_spec: dict[str, Any] = {k: v if k in _READ_SPEC else None for k, v in spec.items()}
    for key in ("containers", "initContainers", "volumes"):
        if key in spec:  # anything but a list stays as written, for the parsers to refuse
            value = spec[key]
            kept_spec[key] = value if not isinstance(value, list) else [
                _kept_volume(v) if key == "volumes" else _kept_container(v) for v in value
            ]  # fmt: skip
    kept: dict[str, Any] = {"metadata": kept_meta, "spec": kept_spec}
    if isinstance(status, Mapping):
        kept_status = {k: status[k] for k in ("phase", "resourceClaimStatuses",
                                               "nominatedNodeName") if k in status}  # fmt: skip
        conds = status.get("conditions")
        if isinstance(conds, list):
            kept_status["conditions"] = [
                {k: c[k] for k in _KEPT_CONDITION if k in c} if isinstance(c, Mapping) else c
                for c in conds
            ]
        kept["status"] = kept_status
    return kept


def _kept_volume(v: Any) -> Any:
    return {k: {} for k in v} | {"name": v.get("name")} if isinstance(v, Mapping) else v


def _kept_container(c: Any) -> Any:
    if not isinstance(c, Mapping):
        return c
    out = {k: c[k] for k in _KEPT_CONTAINER if k in c}
    ports = c.get("ports")
    if isinstance(ports, list):  # host ports tie a pod to nodes (fits.py)
        out["ports"] = [
            {k: p[k] for k in ("hostPort", "containerPort", "protocol") if k in p}
            if isinstance(p, Mapping) else p
            for p in ports
        ]  # fmt: skip
    return out
