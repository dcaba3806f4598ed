"""Kubernetes objects as bench/extender, bench/gang, bench/fleet and the rebalancer's
fleet (tests/unit/rebalancer/fleet.py) build them: a Ready Node of 8 GPUs, a freshness
Lease owned by its Node, a GPU pod. Here, not in bench/, so that tests may use them
(tests never import bench/)."""

from __future__ import annotations

import time
from typing import Any

from gpudaemon.kube.lease import micro_time


def node_obj(name: str, labels: dict[str, str], ann: dict[str, str]) -> dict[str, Any]:
    alloc = {"nvidia.com/gpu": "8", "cpu": "224", "memory": "2Ti", "pods": "110"}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "uid": name,
            "labels": {**labels, "kubernetes.io/hostname": name},
            "annotations": ann,
        },
        "status": {
            "capacity": alloc,
            "allocatable": alloc,
            "conditions": [
                {"type": "Ready", "status": "True", "reason": "Bench", "message": "plain"}
            ],
        },
    }


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


def pod_obj(
    name: str,
    gpus: int,
    node: str = "",
    scheduler: str = "gpudaemon-scheduler",
    labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    res = {"nvidia.com/gpu": str(gpus), "cpu": "1", "memory": "4Gi"}
    spec: dict[str, Any] = {
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
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "uid": name, "namespace": "default", "labels": labels or {}},
        "spec": spec,
        "status": {"phase": "Running"},
    }


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
