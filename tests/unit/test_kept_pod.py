"""The kept form of a pod (cluster/podspec.kept_pod): what the pod watches keep from the
moment a list page or watch event arrives. Every reader of a pod gives the same answer
on the kept form as on the pod as written, and what a tenant can pile into a pod
(environment, command lines, managedFields, container statuses, other tools'
annotations) is not kept."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from gpudaemon.cluster.dra import pod_claim_refs
from gpudaemon.cluster.podspec import (
    MAX_KEPT_ANNOTATION,
    POLICY_ANNOTATION,
    kept_pod,
    pod_gang,
    pod_policy,
    pod_requests,
    pod_shape,
)
from gpudaemon.cluster.selectors import unschedulable_since
from gpudaemon.extender.pods import PendingPods, priority_of
from gpudaemon.rebalancer.fits import pod_fit
from gpudaemon.rebalancer.planner import OPT_IN_ANNOTATION, pod_facts

PRODUCT = "gpudaemon.io/gpu.product"
BIG = "x" * 100_000


def container(name: str, gpus: int, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "image": "registry.example/train:" + "t" * 200,
        "command": ["python", "-c", BIG],
        "env": [{"name": f"E{i}", "value": BIG} for i in range(3)],
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
        "readinessProbe": {"exec": {"command": ["true"]}},
        "resources": {
            "requests": {"cpu": "2", "memory": "8Gi", "nvidia.com/gpu": str(gpus)},
            "limits": {"nvidia.com/gpu": str(gpus)},
        },
        **extra,
    }


def rich_pod(**spec_extra: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "train-0",
            "namespace": "team-a",
            "uid": "u-1",
            "resourceVersion": "42",
            "creationTimestamp": "2026-11-27T04:00:00Z",
            "labels": {"app": "train", "scheduling.x-k8s.io/pod-group": "g1"},
            "annotations": {
                POLICY_ANNOTATION: "binpack",
                OPT_IN_ANNOTATION: "true",
                "gpudaemon.io/long": "y" * 10_000,
                "kubectl.kubernetes.io/last-applied-configuration": BIG,
                "other.example/blob": BIG,
            },
            "ownerReferences": [
                {
                    "apiVersion": "batch/v1",
                    "kind": "Job",
                    "name": "train",
                    "uid": "j-1",
                    "controller": True,
                }
            ],
            "managedFields": [{"manager": "kubectl", "fieldsV1": {"f:x": BIG}}],
        },
        "spec": {
            "schedulerName": "gpudaemon-scheduler",
            "priority": 100,
            "nodeSelector": {PRODUCT: "NVIDIA-H100-80GB-HBM3"},
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchExpressions": [
                                    {
                                        "key": PRODUCT,
                                        "operator": "In",
                                        "values": [
                                            "NVIDIA-H100-80GB-HBM3",
                                            "NVIDIA-A100-SXM4-80GB",
                                        ],
                                    }
                                ]
                            }
                        ]
                    }
                }
            },
            "tolerations": [
                {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
            ],
            "containers": [container("main", 2, ports=[{"containerPort": 8080, "name": "http"}])],
            "initContainers": [
                container("setup", 1),
                container("sidecar", 0, restartPolicy="Always"),
            ],
            "overhead": {"cpu": "250m"},
            "volumes": [
                {"name": "data", "emptyDir": {}},
                {"name": "cfg", "configMap": {"name": "c", "items": [{"key": BIG}]}},
            ],
            "resourceClaims": [{"name": "gpu", "resourceClaimName": "claim-1"}],
            **spec_extra,
        },
        "status": {
            "phase": "Pending",
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": BIG,
                    "lastTransitionTime": "2026-11-27T04:00:05Z",
                }
            ],
            "resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": "claim-1"}],
            "containerStatuses": [{"name": "main", "state": {"waiting": {"message": BIG}}}],
        },
    }


VARIANTS = {
    "rich": rich_pod(),
    "host port": rich_pod(hostNetwork=True),
    "pod-level resources": rich_pod(resources={"requests": {"cpu": "8", "memory": "32Gi"}}),
    "native gang": rich_pod(schedulingGroup={"podGroupName": "native-g"}),
    "pvc volume": rich_pod(volumes=[{"name": "d", "persistentVolumeClaim": {"claimName": "p"}}]),
    "bound": rich_pod(nodeName="gpu-node-1"),
    "no status": {k: v for k, v in rich_pod().items() if k != "status"},
}


def readings(pod: dict[str, Any]) -> dict[str, Any]:
    pending = PendingPods(PRODUCT)
    return {
        "shape": pod_shape(pod, PRODUCT),
        "requests": pod_requests(pod),
        "gang": pod_gang(pod),
        "policy": pod_policy(pod),
        "claims": pod_claim_refs(pod),
        "unschedulable": unschedulable_since(pod),
        "priority": priority_of(pod),
        "fit": pod_fit(pod),
        "facts": pod_facts(pod, PRODUCT, lambda labels: False),
        "pending": pending.parse(pod),
    }


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_every_reader_reads_the_kept_form_as_the_pod_as_written(name: str) -> None:
    pod = VARIANTS[name]
    before = copy.deepcopy(pod)
    kept = kept_pod(pod)
    assert pod == before  # the object as listed is not changed
    assert readings(kept) == readings(pod)


def test_what_a_tenant_piles_into_a_pod_is_not_kept() -> None:
    pod = rich_pod()
    kept = kept_pod(pod)
    raw_size, kept_size = len(json.dumps(pod)), len(json.dumps(kept))
    assert raw_size > 700_000 and kept_size < 5_000, (raw_size, kept_size)
    meta = kept["metadata"]
    assert "managedFields" not in meta
    assert set(meta["annotations"]) == {POLICY_ANNOTATION, OPT_IN_ANNOTATION, "gpudaemon.io/long"}
    assert len(meta["annotations"]["gpudaemon.io/long"]) == MAX_KEPT_ANNOTATION
    main = kept["spec"]["containers"][0]
    assert set(main) == {"name", "resources", "ports"}
    assert kept["spec"]["volumes"][1] == {"name": "cfg", "configMap": {}}
    assert "containerStatuses" not in kept["status"]
    assert kept["spec"]["priority"] == 100


def test_spec_fields_nobody_reads_are_kept_by_name_only() -> None:
    pod = rich_pod(
        hostAliases=[{"ip": "10.0.0.1", "hostnames": [f"h{i}" for i in range(2000)]}],
        readinessGates=[{"conditionType": f"c{i}"} for i in range(2000)],
    )
    kept = kept_pod(pod)
    assert kept["spec"]["hostAliases"] is None and kept["spec"]["readinessGates"] is None
    assert len(json.dumps(kept)) < 5_000
    assert readings(kept) == readings(pod)  # fits.py still sees which fields are set
    assert "message" not in kept["status"]["conditions"][0]


@pytest.mark.parametrize(
    "obj",
    [
        {},
        None,
        [1],
        "pod",
        {"metadata": {}, "spec": []},
        {"spec": {"containers": "bad"}},
        {"spec": {"containers": [1, None]}, "status": "x"},
    ],
)
def test_a_malformed_pod_reads_in_its_kept_form_as_it_did_before(obj: Any) -> None:
    def outcome(pod: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, read in (
            ("shape", lambda p: pod_shape(p, PRODUCT)),
            ("gang", pod_gang),
            ("facts", lambda p: pod_facts(p, PRODUCT, lambda labels: False)),
            ("pending", PendingPods(PRODUCT).parse),
        ):
            try:
                out[name] = read(pod)
            except Exception as e:  # the same refusal, whatever it is
                out[name] = type(e).__name__
        return out

    assert outcome(kept_pod(obj)) == outcome(obj)
