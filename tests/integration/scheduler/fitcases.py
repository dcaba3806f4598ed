"""Seeded cases for the differential test of the rebalancer's `fits` against the real
kube-scheduler: one Node per case (labelled `fits.test/case=<n>`), sometimes a
neighbour Node in the same zone, the pods already bound there, and the case's pod,
pinned to its Node by that label. Every topology domain a case uses (the hostname,
`fits.test/zone`) is unique to the case, so cases do not interact.

The generator is deterministic (one `random.Random(seed)`), and keeps to what the API
server accepts: extended resources as whole numbers with requests equal to limits,
pod-level requests at least the containers' sum, an empty toleration key only with
Exists."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

from gpudaemon.cluster.podspec import effective_requests

CASE_LABEL = "fits.test/case"
ROLE_LABEL = "fits.test/role"
ZONE = "fits.test/zone"
HOSTNAME = "kubernetes.io/hostname"
OTHER_NS = "fits-other"
RUNTIME_CLASS = "fits-overhead"
OVERHEAD = {"cpu": "250m", "memory": "64Mi"}
GPU, FOO, EPH, HUGE = "nvidia.com/gpu", "example.com/foo", "ephemeral-storage", "hugepages-2Mi"
MI = 2**20

# Label keys the node constraints use (never the case label: pinning stays neutral).
KEYS = ("fits.test/a", "fits.test/b", "fits.test/gen")
VALUES = ("x", "y", "z")
# Numbers as Gt/Lt read them, and strings Go's strconv.ParseInt refuses (an underscore,
# beyond int64) or Python's int() might read differently.
NUMBERS = ("1", "4", "5", "9", "10", "007", "1_0", "99999999999999999999", "9223372036854775807")
TAINT_KEYS = ("fits.test/t1", "fits.test/t2")
EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
UNSCHEDULABLE_KEY = "node.kubernetes.io/unschedulable"

CATEGORIES = {
    "resources": 170,
    "node_affinity": 150,
    "taints": 110,
    "cordon": 40,
    "inter_pod": 110,
    "mixed": 100,
}


@dataclass
class Case:
    n: int
    category: str
    node: dict[str, Any]
    neighbours: list[dict[str, Any]] = field(default_factory=list)
    existing: list[dict[str, Any]] = field(default_factory=list)  # bound, spec.nodeName set
    pod: dict[str, Any] = field(default_factory=dict)
    features: set[str] = field(default_factory=set)  # what it exercises, for the report

    @property
    def node_name(self) -> str:
        return str(self.node["metadata"]["name"])


# -- quantities -----------------------------------------------------------------------


def cpu_text(rng: random.Random, milli: int) -> Any:
    forms: list[Any] = [f"{milli}m"]
    if milli % 1000 == 0:
        forms += [str(milli // 1000), milli // 1000]
    elif milli % 10 == 0:
        forms.append(f"{milli / 1000:g}")
    return rng.choice(forms)


def bytes_text(rng: random.Random, b: int) -> str:
    forms = [str(b)]
    if b % 1024 == 0:
        forms.append(f"{b // 1024}Ki")
    if b % MI == 0:
        forms.append(f"{b // MI}Mi")
    if b % 2**30 == 0:
        forms.append(f"{b // 2**30}Gi")
    if b % 10**6 == 0:
        forms.append(f"{b // 10**6}M")
    return rng.choice(forms)


def amount_text(rng: random.Random, resource: str, v: int) -> Any:
    if resource == "cpu":
        return cpu_text(rng, v)
    if resource in ("memory", EPH, HUGE):
        return bytes_text(rng, v)
    return str(v)


def base_units(reqs: dict[str, float]) -> dict[str, int]:
    """Effective requests in the units the nodes are sized in (millicores, bytes)."""
    return {r: math.ceil(round(v * 1000 if r == "cpu" else v, 6)) for r, v in reqs.items()}


# -- resources ------------------------------------------------------------------------


def container_resources(rng: random.Random, small: bool) -> dict[str, Any]:
    """One container's resources: a few of cpu, memory, a GPU, an extended resource,
    ephemeral storage and hugepages; requests, limits alone (then the request), or
    both equal for the devices."""
    req: dict[str, Any] = {}
    lim: dict[str, Any] = {}
    scale = 1 if small else 4
    if rng.random() < 0.85:
        v = rng.choice([1, 100, 250, 500, 1000, 1500]) * scale
        (req if rng.random() < 0.7 else lim)["cpu"] = cpu_text(rng, v)
    if rng.random() < 0.75:
        v = rng.choice([64, 128, 512, 1024, 1536]) * MI * scale
        (req if rng.random() < 0.7 else lim)["memory"] = bytes_text(rng, v)
    if rng.random() < 0.3:
        devices = str(rng.choice([1, 1, 2, 4]))
        lim[GPU] = devices
        if rng.random() < 0.5:
            req[GPU] = devices
    if rng.random() < 0.2:
        devices = str(rng.choice([1, 2, 3]))
        lim[FOO] = devices
        if rng.random() < 0.5:
            req[FOO] = devices
    if rng.random() < 0.25:
        v = rng.choice([100, 1000, 5000]) * MI
        (req if rng.random() < 0.7 else lim)[EPH] = bytes_text(rng, v)
    if rng.random() < 0.08 and ("cpu" in req or "memory" in req or "cpu" in lim or "memory" in lim):
        req[HUGE] = lim[HUGE] = bytes_text(rng, rng.choice([2, 4, 8]) * MI)
    if rng.random() < 0.03:
        req["cpu"] = "0.0001"  # 100u: rounded up to 1m
    out: dict[str, Any] = {}
    if req:
        out["requests"] = req
    if lim:
        out["limits"] = lim
    return out


def container(name: str, resources: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return {"name": name, "image": "example.invalid/x", "resources": resources, **kw}


def pod_spec_resources(rng: random.Random, rich: bool) -> tuple[dict[str, Any], set[str]]:
    """Containers, init containers, sidecars, pod-level resources and overhead."""
    feats: set[str] = set()
    spec: dict[str, Any] = {
        "containers": [
            container(f"c{i}", container_resources(rng, small=not rich))
            for i in range(rng.choice([1, 1, 2, 3]) if rich else 1)
        ]
    }
    if rich and rng.random() < 0.4:
        inits = []
        for i in range(rng.choice([1, 2, 3])):
            sidecar = rng.random() < 0.45
            kw = {"restartPolicy": "Always"} if sidecar else {}
            feats.add("sidecar" if sidecar else "init_container")
            inits.append(container(f"i{i}", container_resources(rng, small=False), **kw))
        spec["initContainers"] = inits
    if rich and rng.random() < 0.25:
        agg = base_units(effective_requests(spec))
        pod_level: dict[str, Any] = {}
        for r in ("cpu", "memory"):
            if rng.random() < 0.7:
                extra = rng.choice([0, 0, 1, 100, 2000]) * (MI if r == "memory" else 1)
                pod_level[r] = amount_text(rng, r, agg.get(r, 0) + extra or 1)
        if pod_level:
            feats.add("pod_level_resources")
            spec["resources"] = {"requests": pod_level}
    if rich and rng.random() < 0.15:
        spec["runtimeClassName"] = RUNTIME_CLASS
        feats.add("overhead")
    return spec, feats


def requests_with_overhead(spec: dict[str, Any]) -> dict[str, int]:
    reqs = dict(effective_requests(spec))
    if spec.get("runtimeClassName") == RUNTIME_CLASS:
        reqs["cpu"] = reqs.get("cpu", 0) + 0.25
        reqs["memory"] = reqs.get("memory", 0) + 64 * MI
    return base_units(reqs)


ROOMY = {
    "cpu": 64000,
    "memory": 256 * 2**30,
    "pods": 110,
    GPU: 8,
    FOO: 8,
    EPH: 100 * 2**30,
    HUGE: 64 * MI,
}
STEP = {"cpu": 1, "memory": 1, EPH: 1, HUGE: 2 * MI, GPU: 1, FOO: 1, "pods": 1}


def tight_allocatable(
    rng: random.Random, need: dict[str, int], used: dict[str, int], pods: int
) -> dict[str, int]:
    """Allocatable around what is used plus what the pod needs: short by one unit,
    exactly enough, or some left over; sometimes a resource the node lacks."""
    alloc: dict[str, int] = {}
    for r in sorted({*need, *used, "cpu", "memory", "pods"}):
        base = pods + 1 if r == "pods" else used.get(r, 0) + need.get(r, 0)
        if r not in need and r != "pods":
            alloc[r] = base + rng.choice([0, 1000])
            continue
        roll = rng.random()
        if roll < 0.12:
            delta = -STEP.get(r, 1)
        elif roll < 0.4:
            delta = 0
        elif roll < 0.45 and r in (GPU, FOO, EPH, HUGE) and not used.get(r):
            alloc.pop(r, None)  # the node does not have it at all
            continue
        else:
            delta = rng.choice([1, 10, 1000]) * STEP.get(r, 1)
        alloc[r] = max(base + delta, 0)
    return alloc


# -- nodes and pods -------------------------------------------------------------------


def node_body(
    name: str, labels: dict[str, str], alloc: dict[str, int], rng: random.Random
) -> dict[str, Any]:
    status = {r: amount_text(rng, r, v) for r, v in alloc.items()}
    status = {r: str(v) for r, v in status.items()}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {HOSTNAME: name, **labels}},
        "spec": {},
        "status": {
            "capacity": dict(status),
            "allocatable": dict(status),
            "conditions": [{"type": "Ready", "status": "True", "reason": "Test", "message": "x"}],
        },
    }


def pod_body(name: str, spec: dict[str, Any], labels: dict[str, str], ns: str = "default"
             ) -> dict[str, Any]:  # fmt: skip
    spec = {"terminationGracePeriodSeconds": 0, **spec}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": spec,
    }


def existing_pods(rng: random.Random, n: int, node: str, count: int) -> list[dict[str, Any]]:
    out = []
    for i in range(count):
        spec, _ = pod_spec_resources(rng, rich=rng.random() < 0.5)
        if rng.random() < 0.15:
            spec["containers"] = [container("c0", {})]  # requests nothing: counts as a pod
        spec["nodeName"] = node
        out.append(pod_body(f"fc-{n}-e{i}", spec, {ROLE_LABEL: "existing"}))
    return out


def used_by_bodies(pods: list[dict[str, Any]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for p in pods:
        for r, v in requests_with_overhead(p["spec"]).items():
            total[r] = total.get(r, 0) + v
    return total


# -- node labels, selectors and affinity ------------------------------------------------


def node_labels(rng: random.Random) -> dict[str, str]:
    out = {}
    for k in KEYS:
        if rng.random() < 0.7:
            out[k] = rng.choice(NUMBERS if k.endswith("gen") else VALUES)
    return out


def requirement(rng: random.Random, labels: dict[str, str]) -> dict[str, Any]:
    key = rng.choice(KEYS)
    op = rng.choice(["In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"])
    if op in ("Exists", "DoesNotExist"):
        return {"key": key, "operator": op}
    if op in ("Gt", "Lt"):
        key = "fits.test/gen" if rng.random() < 0.8 else key
        return {"key": key, "operator": op, "values": [rng.choice(NUMBERS)]}
    pool = list(NUMBERS if key.endswith("gen") else VALUES)
    values = rng.sample(pool, rng.choice([1, 1, 2]))
    if key in labels and rng.random() < 0.5 and labels[key] not in values:
        values[0] = labels[key]
    return {"key": key, "operator": op, "values": values}


def field_requirement(rng: random.Random, name: str) -> dict[str, Any]:
    value = name if rng.random() < 0.6 else f"{name}-elsewhere"
    return {"key": "metadata.name", "operator": rng.choice(["In", "NotIn"]), "values": [value]}


def node_constraints(rng: random.Random, spec: dict[str, Any], name: str,
                     labels: dict[str, str], feats: set[str]) -> None:  # fmt: skip
    if rng.random() < 0.5:
        sel = {}
        for k in rng.sample(KEYS, rng.choice([1, 2])):
            if k in labels and rng.random() < 0.8:
                sel[k] = labels[k]
            else:
                sel[k] = rng.choice(NUMBERS if k.endswith("gen") else VALUES)
        spec["nodeSelector"] = sel
        feats.add("node_selector")
    if rng.random() < 0.8:
        terms = []
        for _ in range(rng.choice([1, 1, 2, 3])):
            term: dict[str, Any] = {}
            if rng.random() < 0.85:
                term["matchExpressions"] = [
                    requirement(rng, labels) for _ in range(rng.choice([1, 1, 2, 3]))
                ]
            if rng.random() < 0.25 or not term:
                term["matchFields"] = [field_requirement(rng, name)]
                feats.add("match_fields")
            for e in term.get("matchExpressions", []):
                feats.add(f"op_{e['operator']}")
            terms.append(term)
        spec["affinity"] = {
            "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": terms}}}  # fmt: skip
        feats.add("node_affinity")


# -- taints and tolerations --------------------------------------------------------------


def taints(rng: random.Random) -> list[dict[str, str]]:
    out: dict[tuple[str, str], dict[str, str]] = {}
    for _ in range(rng.choice([0, 1, 1, 2, 3])):
        t = {"key": rng.choice(TAINT_KEYS), "value": rng.choice(["", "v1", "v2"]),
             "effect": rng.choice(EFFECTS)}  # fmt: skip
        out[(t["key"], t["effect"])] = t
    return list(out.values())


def toleration(rng: random.Random, keys: tuple[str, ...] = TAINT_KEYS) -> dict[str, Any]:
    if rng.random() < 0.1:
        t: dict[str, Any] = {"operator": "Exists"}  # an empty key: every taint
        if rng.random() < 0.5:
            t["key"] = ""
    else:
        t = {"key": rng.choice(keys)}
        if rng.random() < 0.45:
            t["operator"] = "Exists"
        else:
            if rng.random() < 0.7:
                t["operator"] = "Equal"
            if rng.random() < 0.85:
                t["value"] = rng.choice(["", "v1", "v2"])
    if rng.random() < 0.6:
        t["effect"] = rng.choice(EFFECTS)
    if t.get("effect") == "NoExecute" and rng.random() < 0.3:
        t["tolerationSeconds"] = 30
    return t


# -- inter-pod (anti-)affinity ---------------------------------------------------------


def pod_selector(rng: random.Random) -> dict[str, Any] | None:
    roll = rng.random()
    if roll < 0.08:
        return None  # selects nothing
    if roll < 0.15:
        return {}  # selects every pod
    if roll < 0.6:
        return {"matchLabels": {"app": rng.choice(["a", "b"])}}
    op = rng.choice(["In", "NotIn", "Exists", "DoesNotExist"])
    e: dict[str, Any] = {"key": "app", "operator": op}
    if op in ("In", "NotIn"):
        e["values"] = rng.sample(["a", "b", "c"], rng.choice([1, 2]))
    return {"matchExpressions": [e]}


def pod_term(rng: random.Random, feats: set[str]) -> dict[str, Any]:
    term: dict[str, Any] = {"topologyKey": rng.choice([HOSTNAME, ZONE, ZONE, "fits.test/none"])}
    sel = pod_selector(rng)
    if sel is not None:
        term["labelSelector"] = sel
    roll = rng.random()
    if roll < 0.15:
        term["namespaces"] = [rng.choice(["default", OTHER_NS])]
        feats.add("namespaces")
    elif roll < 0.35:
        term["namespaceSelector"] = rng.choice(
            [{}, {"matchLabels": {"kubernetes.io/metadata.name": OTHER_NS}}]
        )
        feats.add("namespace_selector")
    if sel is not None and rng.random() < 0.15:
        # The API server folds these into labelSelector with the pod's own `tier`.
        term[rng.choice(["matchLabelKeys", "mismatchLabelKeys"])] = ["tier"]
        feats.add("match_label_keys")
    return term


# -- one case ----------------------------------------------------------------------------


def make_case(rng: random.Random, n: int, category: str) -> Case:
    name = f"fc-{n}"
    feats: set[str] = {category}
    labels = {CASE_LABEL: str(n), ZONE: f"z{n}"}
    mixed = category == "mixed"
    node_spec: dict[str, Any] = {}
    pod_labels = {ROLE_LABEL: "case", "app": rng.choice(["a", "b", "c"])}
    spec: dict[str, Any]
    existing: list[dict[str, Any]] = []
    neighbours: list[dict[str, Any]] = []

    rich = category == "resources" or (mixed and rng.random() < 0.6)
    spec, rfeats = pod_spec_resources(rng, rich=rich)
    feats |= rfeats
    if category == "resources" or (mixed and rng.random() < 0.5):
        count = rng.choice([0, 1, 1, 2, 3])
        existing = existing_pods(rng, n, name, count)
        if existing:
            feats.add("existing_usage")
        need = requests_with_overhead(spec)
        alloc = tight_allocatable(rng, need, used_by_bodies(existing), len(existing))
        feats |= {f"resource_{r.split('/')[-1]}" for r in need if r not in ("cpu", "memory")}
    else:
        alloc = dict(ROOMY)

    if category in ("node_affinity", "mixed"):
        labels.update(node_labels(rng))
        node_constraints(rng, spec, name, labels, feats)

    if category in ("taints", "mixed") and (not mixed or rng.random() < 0.6):
        node_spec["taints"] = taints(rng)
        tols = [toleration(rng) for _ in range(rng.choice([0, 1, 1, 2, 3]))]
        if tols:
            spec["tolerations"] = tols
        feats |= {f"taint_{t['effect']}" for t in node_spec["taints"]}
        feats |= {f"toleration_{t.get('operator', 'Equal')}" for t in tols}
        feats |= {"toleration_empty_key" for t in tols if not t.get("key")}

    if category == "cordon" or (mixed and rng.random() < 0.25):
        node_spec["unschedulable"] = rng.random() < 0.75
        if rng.random() < 0.5:
            tol = toleration(rng, keys=(UNSCHEDULABLE_KEY, TAINT_KEYS[0]))
            spec["tolerations"] = [*spec.get("tolerations", []), tol]
            feats.add("cordon_toleration")
        if node_spec["unschedulable"]:
            feats.add("cordoned")

    if category == "inter_pod" or (mixed and rng.random() < 0.3):
        pod_anti_affinity_case(rng, n, name, labels, existing, neighbours, spec, feats)
        pod_labels["app"] = rng.choice(["a", "b", "c"])
        if rng.random() < 0.3:
            pod_labels.pop("app")
        if rng.random() < 0.6:
            pod_labels["tier"] = rng.choice(["t1", "t2"])

    spec.setdefault("nodeSelector", {})[CASE_LABEL] = str(n)
    pod = pod_body(f"fc-{n}", spec, pod_labels)
    node = node_body(name, labels, alloc, rng)
    node["spec"] = node_spec
    return Case(n, category, node, neighbours, existing, pod, feats)


def pod_anti_affinity_case(
    rng: random.Random,
    n: int,
    name: str,
    labels: dict[str, str],
    existing: list[dict[str, Any]],
    neighbours: list[dict[str, Any]],
    spec: dict[str, Any],
    feats: set[str],
) -> None:
    """Pods with required anti-affinity (and affinity) on the case's node or on a
    neighbour in its zone; sometimes the case pod's own required terms."""
    hosts = [name]
    if rng.random() < 0.4:
        other = f"{name}-b"
        zone = labels[ZONE] if rng.random() < 0.7 else f"z{n}b"
        neighbours.append(node_body(other, {ZONE: zone}, dict(ROOMY), rng))
        hosts.append(other)
        feats.add("neighbour_node")
    for _ in range(rng.choice([1, 1, 2, 3])):
        ns = OTHER_NS if rng.random() < 0.2 else "default"
        pl: dict[str, str] = {ROLE_LABEL: "existing"}
        if rng.random() < 0.8:
            pl["app"] = rng.choice(["a", "b"])
        if rng.random() < 0.6:
            pl["tier"] = rng.choice(["t1", "t2"])
        pspec: dict[str, Any] = {
            "containers": [container("c0", {"requests": {"cpu": "10m"}})],
            "nodeName": rng.choice(hosts),
        }
        if rng.random() < 0.75:
            aff: dict[str, Any] = {"podAntiAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": [
                    pod_term(rng, feats) for _ in range(rng.choice([1, 1, 2]))]}}  # fmt: skip
            if rng.random() < 0.2:
                aff["podAffinity"] = {"requiredDuringSchedulingIgnoredDuringExecution": [
                    pod_term(rng, feats)]}  # fmt: skip
            pspec["affinity"] = aff
            feats.add("existing_anti_affinity")
        existing.append(pod_body(f"fc-{n}-e{len(existing)}", pspec, pl, ns))
    if rng.random() < 0.25:
        kind = rng.choice(["podAffinity", "podAntiAffinity"])
        term = pod_term(rng, feats)
        if term["topologyKey"] == "fits.test/none" or "namespaceSelector" in term:
            term["topologyKey"] = HOSTNAME  # keep other cases' pods out of its reach
            term.pop("namespaceSelector", None)
        spec["affinity"] = {
            **(spec.get("affinity") or {}),
            kind: {"requiredDuringSchedulingIgnoredDuringExecution": [term]},
        }
        feats.add(f"own_{kind}")
    elif rng.random() < 0.2:
        spec["affinity"] = {**(spec.get("affinity") or {}), "podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 10, "podAffinityTerm": pod_term(rng, feats)}]}}  # fmt: skip
        feats.add("own_preferred_anti_affinity")


def generate(seed: int = 20260, categories: dict[str, int] | None = None) -> list[Case]:
    rng = random.Random(seed)
    cases = []
    n = 0
    for category, count in (categories or CATEGORIES).items():
        for _ in range(count):
            cases.append(make_case(rng, n, category))
            n += 1
    return cases
