"""The test suite's builders of Kubernetes objects: one `node()`, one `pod()`, a
freshness Lease owned by its Node, and the quarantine check. A Node defaults to a Ready
node of 8 GPUs as bench/extender, bench/gang and bench/fleet build it; with `product` it
carries what the agent writes (GPU labels and the `gpus` annotation); with `minimal`
only what the rebalancer's unit tests give it. Here, not in bench/, so that tests may
use them (tests never import bench/)."""

from __future__ import annotations

import json
import time
from typing import Any

from gpudaemon.kube.lease import micro_time

P = "gpudaemon.io/"
# The controller that owns a pod the rebalancer may move (a bare pod it never evicts).
OWNER = [{"kind": "ReplicaSet", "name": "rs", "controller": True, "uid": "rs"}]
UNSCHEDULABLE = {
    "type": "PodScheduled",
    "status": "False",
    "reason": "Unschedulable",
    "lastTransitionTime": "2026-11-25T00:00:00Z",
}


def gpus_annotation(gpus: int, uuid_prefix: str, sick: dict[int, list[str]]) -> str:
    """The agent's `gpus` annotation: GPU-<uuid_prefix>-<i> each; `sick`: GPU index ->
    the pods holding it."""
    entries = []
    for i in range(gpus):
        e: dict[str, Any] = {
            "index": i,
            "uuid": f"GPU-{uuid_prefix}-{i}",
            "memory_total_mib": 81559,
        }
        if i in sick:
            e.update(healthy=False, reason="xid 79", pods=sick[i])
        entries.append(e)
    return json.dumps(entries)


def node(
    name: str,
    gpus: int = 8,
    *,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    uid: str = "",
    product: str = "",
    sick: dict[int, list[str]] | None = None,
    uuid_prefix: str = "",
    minimal: bool = False,
) -> dict[str, Any]:
    """A GPU Node (uid: `name` unless given). `product`: labelled as the agent labels it
    (gpu.count, gpu.healthy, gpu.product, the `gpus` annotation with `sick` GPUs and
    UUIDs after `uuid_prefix` or the name). `minimal`: metadata and a 64-CPU
    allocatable only (no kind, hostname label, capacity or Ready condition)."""
    labels = dict(labels or {})
    annotations = dict(annotations or {})
    if product:
        sick = sick or {}
        labels |= {
            P + "gpu.count": str(gpus),
            P + "gpu.healthy": str(gpus - len(sick)),
            P + "gpu.product": product,
        }
        annotations[P + "gpus"] = gpus_annotation(gpus, uuid_prefix or name, sick)
    meta = {"name": name, "uid": uid or name, "labels": labels, "annotations": annotations}
    if minimal:
        alloc = {"nvidia.com/gpu": str(gpus), "cpu": "64", "memory": "256Gi", "pods": "110"}
        return {"metadata": meta, "status": {"allocatable": alloc}}
    alloc = {"nvidia.com/gpu": str(gpus), "cpu": "224", "memory": "2Ti", "pods": "110"}
    meta["labels"] = {**labels, "kubernetes.io/hostname": name}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": meta,
        "status": {
            "capacity": alloc,
            "allocatable": alloc,
            "conditions": [
                {"type": "Ready", "status": "True", "reason": "Bench", "message": "plain"}
            ],
        },
    }


def node_obj(name: str, labels: dict[str, str], ann: dict[str, str]) -> dict[str, Any]:
    """bench's spelling of `node(name, labels=..., annotations=...)`."""
    return node(name, labels=labels, annotations=ann)


def lease_obj(name: str, uid: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "gpudaemon"}
    if uid:
        meta["ownerReferences"] = [{"apiVersion": "v1", "kind": "Node", "name": name, "uid": uid}]
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": meta,
        "spec": {
            "holderIdentity": "bench",
            "leaseDurationSeconds": 3600,
            "renewTime": micro_time(time.time()),
        },
    }


def pod(
    name: str,
    gpus: int = 1,
    node: str = "",
    scheduler: str = "gpudaemon-scheduler",
    labels: dict[str, str] | None = None,
    *,
    namespace: str = "default",
    uid: str = "",
    owned: bool = False,
    opt_in: bool = False,
    unschedulable: bool = False,
    model: str = "",
    minimal: bool = False,
) -> dict[str, Any]:
    """A pod of `gpus` GPUs (uid: `name` unless given), on `node` or not. `owned`: by
    a ReplicaSet; `opt_in`: to the rebalancer; `unschedulable`: so marked by the
    scheduler (and pending); `model`: pinned to a GPU product. Without `minimal`, a
    full pod (1 CPU, 4 GiB, GPU limits, Running); with it, only what the rebalancer's
    unit tests give it: GPU and CPU requests, Pending without a node."""
    meta: dict[str, Any] = {"name": name, "uid": uid or name, "namespace": namespace}
    if not minimal:
        meta["labels"] = labels or {}
    if owned:
        meta["ownerReferences"] = OWNER
    if opt_in:
        meta["annotations"] = {P + "rebalance": "true"}
    spec: dict[str, Any]
    if minimal:
        requests = {"nvidia.com/gpu": str(gpus), "cpu": "1"}
        spec = {"nodeName": node, "schedulerName": scheduler,
                "containers": [{"name": "c", "resources": {"requests": requests}}]}  # fmt: skip
    else:
        res = {"nvidia.com/gpu": str(gpus), "cpu": "1", "memory": "4Gi"}
        spec = {
            "schedulerName": scheduler,
            "containers": [
                {
                    "name": "c",
                    "image": "example.invalid/x",
                    "resources": {"requests": res, "limits": {"nvidia.com/gpu": str(gpus)}},
                }
            ],
        }
        if node:
            spec["nodeName"] = node
    if model:
        spec["nodeSelector"] = {P + "gpu.product": model}
    pending = not node and (minimal or unschedulable)
    status: dict[str, Any] = {"phase": "Pending" if pending else "Running"}
    if unschedulable:
        status["conditions"] = [dict(UNSCHEDULABLE)]
    obj = {"metadata": meta, "spec": spec, "status": status}
    return obj if minimal else {"apiVersion": "v1", "kind": "Pod", **obj}


pod_obj = pod  # bench's spelling


def quarantined(node: dict[str, Any], prefix: str = "gpudaemon.io/") -> bool:
    """A Node shows all three of the agent's quarantine: label `gpu.unhealthy` not 0,
    condition `GPUHealthy=False`, taint `gpu-unhealthy:NoSchedule`."""
    labels = node["metadata"].get("labels") or {}
    conds = {c["type"]: c["status"] for c in node.get("status", {}).get("conditions") or []}
    taints = {(t["key"], t["effect"]) for t in node.get("spec", {}).get("taints") or []}
    return (
        labels.get(prefix + "gpu.unhealthy", "0") != "0"
        and conds.get("GPUHealthy") == "False"
        and (prefix + "gpu-unhealthy", "NoSchedule") in taints
    )
