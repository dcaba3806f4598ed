"""A pod's effective requests follow kube-scheduler's rule; affinity gives GPU models."""

from __future__ import annotations

from typing import Any

import pytest

from gpudaemon.cluster.podspec import gpu_models, pod_policy, pod_shape, quantity
from gpudaemon.cluster.state import PodShape

P = "gpudaemon.io/gpu.product"


def c(
    gpu: Any = None, cpu: Any = None, mem: Any = None, limits_gpu: Any = None, **kw: Any
) -> dict[str, Any]:
    req = {
        k: v for k, v in (("nvidia.com/gpu", gpu), ("cpu", cpu), ("memory", mem)) if v is not None
    }
    res: dict[str, Any] = {"requests": req}
    if limits_gpu is not None:
        res["limits"] = {"nvidia.com/gpu": limits_gpu}
    return {"name": "c", "resources": res, **kw}


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("500m", 0.5),
        ("2", 2.0),
        (3, 3.0),
        ("1Gi", 2**30),
        ("1G", 1e9),
        ("128974848", 128974848.0),
        ("1.5", 1.5),
        ("100Mi", 100 * 2**20),
        ("1e3", 1000.0),
    ],
)
def test_quantity_parses_kubernetes_suffixes(text: Any, value: float) -> None:
    assert quantity(text) == value


@pytest.mark.parametrize(
    "bad",
    ["", "abc", "1Zi", None, True, [1], "1.2.3", "1e400", "1e400Gi", float("inf"), float("nan")],
)
def test_quantity_rejects_garbage(bad: Any) -> None:
    with pytest.raises(ValueError):
        quantity(bad)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        # app containers add up
        (
            {"containers": [c(gpu=1, cpu="500m", mem="1Gi"), c(gpu=2, cpu="1", mem="1Gi")]},
            PodShape(3, 1500, 2 * 2**30),
        ),
        # a GPU limit without a request: the request defaults to the limit
        ({"containers": [c(limits_gpu=4)]}, PodShape(4)),
        # a plain init container: max(sum of apps, the biggest init)
        (
            {"initContainers": [c(gpu=8, cpu="100m")], "containers": [c(gpu=2, cpu="2")]},
            PodShape(8, 2000),
        ),
        # a sidecar (restartable init) runs beside the apps: it adds
        (
            {"initContainers": [c(gpu=1, restartPolicy="Always")], "containers": [c(gpu=2)]},
            PodShape(3),
        ),
        # an init after a sidecar runs beside it
        (
            {
                "initContainers": [c(gpu=1, restartPolicy="Always"), c(gpu=4)],
                "containers": [c(gpu=1)],
            },
            PodShape(5),
        ),
        # pod overhead adds CPU and memory
        (
            {"containers": [c(gpu=1, cpu="1")], "overhead": {"cpu": "250m", "memory": "64Mi"}},
            PodShape(1, 1250, 64 * 2**20),
        ),
        # no GPU at all
        ({"containers": [c(cpu="1")]}, PodShape(0, 1000)),
        # CPU rounds up to whole millicores, as Quantity.MilliValue() does
        ({"containers": [c(cpu="0.0001")]}, PodShape(0, 1)),
        ({}, PodShape(0)),
    ],
)
def test_pod_shape_follows_the_scheduler_request_rule(
    spec: dict[str, Any], expected: PodShape
) -> None:
    assert pod_shape({"spec": spec}, P) == expected


def _affinity(*terms: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": t} for t in terms]
            }
        }
    }


@pytest.mark.parametrize(
    ("spec", "models"),
    [
        ({}, None),
        ({"nodeSelector": {P: "T4"}}, {"T4"}),
        (
            {"affinity": _affinity([{"key": P, "operator": "In", "values": ["T4", "A10"]}])},
            {"T4", "A10"},
        ),
        # ORed terms: constrained only if every term pins the product
        (
            {
                "affinity": _affinity(
                    [{"key": P, "operator": "In", "values": ["T4"]}],
                    [{"key": P, "operator": "In", "values": ["P100"]}],
                )
            },
            {"T4", "P100"},
        ),
        (
            {
                "affinity": _affinity(
                    [{"key": P, "operator": "In", "values": ["T4"]}],
                    [{"key": "zone", "operator": "In", "values": ["a"]}],
                )
            },
            None,
        ),
        # other operators do not pin a set of models
        ({"affinity": _affinity([{"key": P, "operator": "NotIn", "values": ["T4"]}])}, None),
        # nodeSelector and affinity together: both must hold
        (
            {
                "nodeSelector": {P: "T4"},
                "affinity": _affinity([{"key": P, "operator": "In", "values": ["T4", "A10"]}]),
            },
            {"T4"},
        ),
    ],
)
def test_gpu_models_come_from_required_affinity(
    spec: dict[str, Any], models: set[str] | None
) -> None:
    got = gpu_models({"spec": spec}, P)
    assert got == (None if models is None else frozenset(models))


def test_policy_annotation() -> None:
    assert pod_policy({"metadata": {"annotations": {"gpudaemon.io/policy": "spread"}}}) == "spread"
    assert pod_policy({"metadata": {}}) is None


def test_a_long_policy_annotation_is_cut_so_no_answer_quotes_it_whole() -> None:
    from gpudaemon.cluster.podspec import MAX_POLICY_NAME, POLICY_ANNOTATION, pod_policy

    pod = {"metadata": {"annotations": {POLICY_ANNOTATION: "x" * 200_000}}}
    got = pod_policy(pod)
    assert got is not None and len(got) == MAX_POLICY_NAME + 3 and got.endswith("...")
    assert pod_policy({"metadata": {"annotations": {POLICY_ANNOTATION: "binpack"}}}) == "binpack"
