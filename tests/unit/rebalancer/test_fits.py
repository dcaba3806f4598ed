"""The scheduler's filters as the rebalancer judges them from its caches (issue 28),
row by row: requests by kube-scheduler's rule, resources left, nodeSelector and node
affinity, taints and tolerations, cordoned nodes, other pods' anti-affinity, and what
makes a pod unjudgeable."""

from __future__ import annotations

from typing import Any

import pytest

from gpudaemon.rebalancer.fits import (
    NodeFit,
    excluded_domains,
    in_domains,
    insufficient,
    node_fit,
    pod_fit,
    pod_requests,
    static_reason,
    tolerates,
    untolerated,
)


def c(requests: dict[str, Any] | None = None, limits: dict[str, Any] | None = None,
      **kw: Any) -> dict[str, Any]:  # fmt: skip
    return {"name": "c", "resources": {"requests": requests or {}, "limits": limits or {}}, **kw}


@pytest.mark.parametrize(
    ("spec", "want"),
    [
        ({"containers": [c({"cpu": "500m", "memory": "1Gi"})]},
         {"cpu": 500, "memory": 1 << 30, "pods": 1}),
        # A limit alone is the request (API defaulting), for extended resources too.
        ({"containers": [c(limits={"example.com/foo": "2"})]}, {"example.com/foo": 2, "pods": 1}),
        ({"containers": [c({"ephemeral-storage": "10G", "hugepages-2Mi": "4Mi"})]},
         {"ephemeral-storage": 10**10, "hugepages-2Mi": 4 << 20, "pods": 1}),
        # Containers add up; an init container counts by its peak only.
        ({"containers": [c({"cpu": "1"}), c({"cpu": "2"})],
          "initContainers": [c({"cpu": "4", "example.com/foo": "1"})]},
         {"cpu": 4000, "example.com/foo": 1, "pods": 1}),
        ({"containers": [c({"cpu": "3"})], "initContainers": [c({"cpu": "2"})]},
         {"cpu": 3000, "pods": 1}),
        # A sidecar (restartPolicy Always) runs beside the containers.
        ({"containers": [c({"cpu": "1"})],
          "initContainers": [c({"cpu": "1"}, restartPolicy="Always")]},
         {"cpu": 2000, "pods": 1}),
        # Overhead is added, for every resource it names.
        ({"containers": [c({"cpu": "1"})], "overhead": {"cpu": "250m", "memory": "64Mi"}},
         {"cpu": 1250, "memory": 64 << 20, "pods": 1}),
        # Pod-level resources replace what the containers add up to.
        ({"containers": [c({"cpu": "1"})], "resources": {"requests": {"cpu": "8"}}},
         {"cpu": 8000, "pods": 1}),
        ({"containers": [c({"cpu": "0.0001"})]}, {"cpu": 1, "pods": 1}),  # rounded up
        # ... but only CPU, memory and hugepages: a GPU still adds up per container.
        ({"containers": [c({"cpu": "1", "nvidia.com/gpu": "2"}), c({"nvidia.com/gpu": "1"})],
          "initContainers": [c({"cpu": "500m"}, restartPolicy="Always")],
          "resources": {"requests": {"cpu": "8", "memory": "32Gi"}}},
         {"cpu": 8000, "memory": 32 << 30, "nvidia.com/gpu": 3, "pods": 1}),
        # A pod-level limit alone is the pod-level request.
        ({"containers": [c({"cpu": "1"})], "resources": {"limits": {"cpu": "4"}}},
         {"cpu": 4000, "pods": 1}),
    ],
)  # fmt: skip
def test_pod_requests_follow_the_schedulers_rule(
    spec: dict[str, Any], want: dict[str, int]
) -> None:
    assert pod_requests(spec) == want


def test_a_bad_quantity_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        pod_requests({"containers": [c({"example.com/foo": "lots"})]})


def test_insufficient_names_what_is_short_including_resources_the_node_lacks() -> None:
    alloc = {"cpu": 8000, "memory": 16 << 30, "pods": 110}
    assert insufficient({"cpu": 4000, "pods": 1}, alloc, {"cpu": 4000}) == []
    assert insufficient({"cpu": 4001, "pods": 1}, alloc, {"cpu": 4000}) == ["cpu"]
    assert insufficient({"example.com/foo": 1}, alloc, {}) == ["example.com/foo"]
    assert insufficient({"pods": 1}, alloc, {"pods": 110}) == ["pods"]
    assert insufficient({"pods": 1}, {}, {}) == ["pods"]  # no `pods`: the node takes none


def node(**kw: Any) -> NodeFit:
    kw.setdefault("name", "n1")
    kw.setdefault("labels", {"zone": "a", "gen": "5", "kubernetes.io/hostname": "n1"})
    return NodeFit(**kw)


def fit(spec: dict[str, Any], **meta: Any) -> Any:
    return pod_fit({"metadata": {"namespace": "ml", **meta},
                    "spec": {"containers": [c()], **spec}})  # fmt: skip


def affinity(*terms: dict[str, Any]) -> dict[str, Any]:
    return {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": list(terms)}}}}  # fmt: skip


def expr(key: str, op: str, *values: str) -> dict[str, Any]:
    return {"matchExpressions": [{"key": key, "operator": op, "values": list(values)}]}


@pytest.mark.parametrize(
    ("spec", "node_kw", "lands"),
    [
        ({}, {}, True),
        ({"nodeSelector": {"zone": "a"}}, {}, True),
        ({"nodeSelector": {"zone": "b"}}, {}, False),
        ({"nodeSelector": {"pool": "x"}}, {}, False),
        (affinity(expr("zone", "In", "a", "b")), {}, True),
        (affinity(expr("zone", "In", "b")), {}, False),
        (affinity(expr("zone", "In", "b"), expr("zone", "In", "a")), {}, True),  # terms ORed
        (affinity({"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]},
                                        {"key": "gen", "operator": "In", "values": ["4"]}]}),
         {}, False),  # expressions ANDed
        (affinity(expr("zone", "NotIn", "a")), {}, False),
        (affinity(expr("pool", "NotIn", "a")), {}, True),  # no label: NotIn matches
        (affinity(expr("zone", "Exists")), {}, True),
        (affinity(expr("pool", "Exists")), {}, False),
        (affinity(expr("pool", "DoesNotExist")), {}, True),
        (affinity(expr("gen", "Gt", "4")), {}, True),
        (affinity(expr("gen", "Gt", "5")), {}, False),
        (affinity(expr("gen", "Lt", "6")), {}, True),
        (affinity(expr("zone", "Lt", "6")), {}, False),  # not a number: no match
        # Gt and Lt read numbers as Go's strconv.ParseInt does: no underscores, int64.
        (affinity(expr("gen", "Lt", "1_0")), {}, False),
        (affinity(expr("gen", "Gt", "4")), {"labels": {"gen": "1_0"}}, False),
        (affinity(expr("gen", "Lt", "99999999999999999999")), {}, False),
        (affinity(expr("gen", "Gt", "4")), {"labels": {"gen": "99999999999999999999"}}, False),
        (affinity(expr("gen", "Gt", "4")), {"labels": {"gen": "9223372036854775807"}}, True),
        (affinity(expr("gen", "Gt", "6")), {"labels": {"gen": "007"}}, True),
        (affinity({"matchFields": [{"key": "metadata.name", "operator": "In",
                                    "values": ["n1"]}]}), {}, True),
        (affinity({"matchFields": [{"key": "metadata.name", "operator": "NotIn",
                                    "values": ["n1"]}]}), {}, False),
        (affinity({}), {}, False),  # an empty term matches no node
        ({"nodeName": "n2"}, {}, False),
        ({"nodeName": "n1"}, {}, True),
        ({}, {"unschedulable": True}, False),  # cordoned
        ({"tolerations": [{"key": "node.kubernetes.io/unschedulable", "operator": "Exists"}]},
         {"unschedulable": True}, True),
        ({}, {"taints": (("gpu", "team-a", "NoSchedule"),)}, False),
        ({"tolerations": [{"key": "gpu", "value": "team-a"}]},
         {"taints": (("gpu", "team-a", "NoSchedule"),)}, True),
        ({"tolerations": [{"key": "gpu", "value": "team-b"}]},
         {"taints": (("gpu", "team-a", "NoSchedule"),)}, False),
        ({"tolerations": [{"operator": "Exists"}]},
         {"taints": (("gpu", "team-a", "NoExecute"),)}, True),
        ({"tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoExecute"}]},
         {"taints": (("gpu", "team-a", "NoSchedule"),)}, False),
    ],
)  # fmt: skip
def test_static_filters(spec: dict[str, Any], node_kw: dict[str, Any], lands: bool) -> None:
    p = fit(spec)
    assert not p.unjudgeable
    assert (static_reason(p, node(**node_kw)) == "") is lands


@pytest.mark.parametrize(
    ("toleration", "taint", "ok"),
    [
        ({"key": "k", "operator": "Equal", "value": "v"}, ("k", "v", "NoSchedule"), True),
        ({"key": "k", "value": "v"}, ("k", "w", "NoSchedule"), False),
        ({"key": "k", "operator": "Exists"}, ("k", "w", "NoSchedule"), True),
        ({"key": "", "operator": "Exists"}, ("any", "w", "NoExecute"), True),
        ({"key": "k", "operator": "Exists", "effect": "NoSchedule"}, ("k", "", "NoExecute"), False),
        ({"key": "k"}, ("k", "", "NoSchedule"), True),  # Equal with no value: empty value
        ({"key": "k", "operator": "Gt", "value": "1"}, ("k", "2", "NoSchedule"), False),
    ],
)  # fmt: skip
def test_tolerations_as_core_v1_has_them(
    toleration: dict[str, Any], taint: tuple[str, str, str], ok: bool
) -> None:
    assert tolerates(toleration, taint) is ok
    assert (untolerated([taint], [toleration]) is None) is ok


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ({"affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
            {"topologyKey": "kubernetes.io/hostname", "labelSelector": {}}]}}}, "podAntiAffinity"),
        ({"affinity": {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
            {"topologyKey": "zone", "labelSelector": {}}]}}}, "podAffinity"),
        ({"topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone",
                                         "whenUnsatisfiable": "DoNotSchedule"}]}, "topology"),
        ({"resourceClaims": [{"name": "gpu", "resourceClaimName": "x"}]}, "resourceClaims"),
        ({"volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "d"}}]}, "data"),
        ({"schedulingGates": [{"name": "wait"}]}, "gates"),
        ({"containers": [c(ports=[{"containerPort": 80, "hostPort": 80}])]}, "host ports"),
        ({"futureField": {"x": 1}}, "futureField"),
        (affinity(expr("zone", "Near", "a")), "operator"),
        (affinity({"matchFields": [{"key": "metadata.uid", "operator": "In",
                                    "values": ["x"]}]}), "metadata.uid"),
        ({"affinity": {"nodeAffinity": "x"}}, "cannot be read"),
    ],
)  # fmt: skip
def test_what_the_caches_cannot_tell_makes_a_pod_unjudgeable(spec: dict[str, Any],
                                                             why: str) -> None:  # fmt: skip
    p = fit(spec)
    assert why in p.unjudgeable


@pytest.mark.parametrize(
    "spec",
    [
        {"affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 1, "podAffinityTerm": {"topologyKey": "zone"}}]}}},
        {"topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone",
                                        "whenUnsatisfiable": "ScheduleAnyway"}]},
        {"volumes": [{"name": "s", "secret": {"secretName": "x"}},
                     {"name": "t", "emptyDir": {}}, {"name": "p", "projected": {"sources": []}}]},
        {"containers": [c(ports=[{"containerPort": 80}])], "serviceAccountName": "x",
         "priorityClassName": "high", "securityContext": {}, "dnsPolicy": "ClusterFirst"},
    ],
)  # fmt: skip
def test_what_the_caches_can_tell_is_judged(spec: dict[str, Any]) -> None:
    assert fit(spec).unjudgeable == ""


def test_node_fit_reads_allocatable_taints_and_cordon() -> None:
    n = node_fit({"metadata": {"name": "n1", "labels": {"a": "b"}},
                  "spec": {"unschedulable": True, "taints": [
                      {"key": "k", "value": "v", "effect": "NoExecute"},
                      {"key": "soft", "effect": "PreferNoSchedule"}]},
                  "status": {"allocatable": {"cpu": "63500m", "memory": "250Gi",
                                             "example.com/foo": "4", "bad": "??"}}})  # fmt: skip
    assert n.name == "n1" and n.unschedulable and n.taints == (("k", "v", "NoExecute"),)
    assert n.allocatable == {"cpu": 63500, "memory": 250 << 30, "example.com/foo": 4, "bad": 0}


def test_other_pods_required_anti_affinity_keeps_the_pod_out_of_their_domain() -> None:
    term = {"topologyKey": "zone", "labelSelector": {"matchLabels": {"app": "db"}}}
    other = fit({}, labels={"app": "other"})
    other = type(other)(**{**other.__dict__, "anti_affinity": (term,)})
    there = node(labels={"zone": "a"})
    db = fit({}, labels={"app": "db"})
    web = fit({}, labels={"app": "web"})
    assert excluded_domains(db, [(other, there)]) == {("zone", "a")}
    assert in_domains(node(name="n2", labels={"zone": "a"}), {("zone", "a")})
    assert not in_domains(node(name="n3", labels={"zone": "b"}), {("zone", "a")})
    assert excluded_domains(web, [(other, there)]) == set()
    elsewhere = fit({}, labels={"app": "db"})
    elsewhere = type(elsewhere)(**{**elsewhere.__dict__, "namespace": "other-ns"})
    assert excluded_domains(elsewhere, [(other, there)]) == set()  # its own namespace only
    any_ns = {**term, "namespaceSelector": {}}
    other2 = type(other)(**{**other.__dict__, "anti_affinity": (any_ns,)})
    assert excluded_domains(elsewhere, [(other2, there)]) == {("zone", "a")}


@pytest.mark.parametrize(
    "spec",
    [
        {"containers": [c({"cpu": "1", "nvidia.com/gpu": "8"})],
         "resources": {"requests": {"cpu": "8", "memory": "64Gi"}}},
        {"containers": [c({"cpu": "2"}, {"nvidia.com/gpu": "1"})],
         "initContainers": [c({"cpu": "6", "memory": "1Gi"}),
                            c({"cpu": "1"}, restartPolicy="Always")],
         "overhead": {"cpu": "250m", "memory": "128Mi"}},
        {"containers": [c(limits={"cpu": "3", "memory": "2Gi", "nvidia.com/mig-1g.10gb": "2"})]},
    ],
)  # fmt: skip
def test_the_extender_and_the_rebalancer_read_one_pod_request_rule(spec: dict[str, Any]) -> None:
    """One rule (cluster/podspec.effective_requests): the extender's pod shape and the
    rebalancer's fit give the same CPU, memory and GPUs for the same pod (a pod with
    pod-level resources once got 1 CPU from one and 8 from the other)."""
    from gpudaemon.cluster.podspec import pod_shape

    shape = pod_shape({"spec": spec}, "gpudaemon.io/gpu.product")
    fit = pod_requests(spec)
    assert shape.cpu_milli == fit.get("cpu", 0)
    assert shape.memory_bytes == fit.get("memory", 0)
    assert shape.gpus == fit.get("nvidia.com/gpu", 0)
    assert dict(shape.mig) == {
        k.removeprefix("nvidia.com/mig-"): v
        for k, v in fit.items()
        if k.startswith("nvidia.com/mig-")
    }
