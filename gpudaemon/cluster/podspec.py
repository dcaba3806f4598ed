"""A pod's effective requests, by the same rule kube-scheduler uses.

effective = max(sum(app containers) + sum(restartable init "sidecars"),
                max over init containers of (its request + sidecars started before it))
            + pod overhead

Only `requests` count (a limit with no request defaults the request to the limit, as
the API server does for extended resources, so both are read).
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


def _container_requests(c: Mapping[str, Any]) -> Resources:
    res = c.get("resources") or {}
    limits = res.get("limits") or {}
    requests = res.get("requests") or {}
    out: Resources = {}
    for name in (GPU_RESOURCE, "cpu", "memory"):
        if name in requests:
            out[name] = quantity(requests[name])
        elif name == GPU_RESOURCE and name in limits:  # extended: request defaults to limit
            out[name] = quantity(limits[name])
    for where in (limits, requests):  # requests win: read last
        for name, v in where.items():
            if isinstance(name, str) and name.startswith(MIG_RESOURCE_PREFIX):
                out[name] = quantity(v)
    return out


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


def pod_requests(pod: Mapping[str, Any]) -> Resources:
    """Effective requests of GPUs, MIG devices by resource, CPU (cores) and memory
    (bytes) for the pod."""
    spec = pod.get("spec") or {}
    total: Resources = {}
    for c in spec.get("containers") or []:
        total = _add(total, _container_requests(c))
    sidecars: Resources = {}
    init_peak: Resources = {}
    for c in spec.get("initContainers") or []:
        req = _container_requests(c)
        if c.get("restartPolicy") == "Always":  # a sidecar: runs beside what follows
            sidecars = _add(sidecars, req)
            init_peak = _max(init_peak, sidecars)
        else:
            init_peak = _max(init_peak, _add(req, sidecars))
    total = _max(_add(total, sidecars), init_peak)
    overhead = {k: quantity(v) for k, v in (spec.get("overhead") or {}).items()}
    return _add(total, {k: v for k, v in overhead.items() if k in ("cpu", "memory")})


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


def pod_gang(pod: Mapping[str, Any]) -> str:
    """`namespace/podgroup` of the pod's gang, "" when it is in none."""
    meta = pod.get("metadata") or {}
    group = (meta.get("labels") or {}).get(GANG_LABEL)
    if not isinstance(group, str) or not group:
        return ""
    return f"{meta.get('namespace') or ''}/{group}"


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
