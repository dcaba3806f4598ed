"""resource.k8s.io/v1 objects as NVIDIA's DRA driver (dra-driver-nvidia-gpu 0.4.x) and
Kubernetes write them: for unit tests, the integration rig's stand-in and bench."""

from __future__ import annotations

import re
from typing import Any

DRIVER = "gpu.nvidia.com"
GPU_CEL = "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'"
MIG_CEL = "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'mig'"


def gpu_uuid(node: str, i: int) -> str:
    return f"GPU-{abs(hash(node)) % 10**8:08d}-{i:04d}"


def _s(v: str) -> dict[str, str]:
    return {"string": v}


def gpu_device(node: str, i: int, taints: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    d: dict[str, Any] = {
        "name": f"gpu-{i}",
        "attributes": {
            "type": _s("gpu"),
            "uuid": _s(gpu_uuid(node, i)),
            "productName": _s("NVIDIA H100 80GB HBM3"),
            "architecture": _s("Hopper"),
            "cudaComputeCapability": {"version": "9.0.0"},
            "driverVersion": {"version": "570.124.6"},
            "resource.kubernetes.io/pciBusID": _s(f"0000:{0x18 + i:02x}:00.0"),
            "index": {"int": i},
            "minor": {"int": i},
        },
        "capacity": {"memory": {"value": "81559Mi"}},
    }
    if taints:
        d["taints"] = taints
    return d


def mig_device(node: str, gpu: int, n: int, profile: str = "1g.10gb") -> dict[str, Any]:
    return {
        # a DNS label, as the API server requires of a device name
        "name": f"gpu-{gpu}-mig-{re.sub(r'[^a-z0-9]+', '-', profile)}-{n}",
        "attributes": {
            "type": _s("mig"),
            "uuid": _s(f"MIG-{node}-{gpu}-{n}"),
            "parentUUID": _s(gpu_uuid(node, gpu)),
            "profile": _s(profile),
            "productName": _s("NVIDIA H100 80GB HBM3"),
        },
        "capacity": {"memory": {"value": "9856Mi"}},
    }


def nvidia_slice(
    node: str, gpus: int = 8, devices: list[dict[str, Any]] | None = None, name: str = ""
) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name or f"{node}-gpu.nvidia.com"},
        "spec": {
            "driver": DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": devices
            if devices is not None
            else [gpu_device(node, i) for i in range(gpus)],
        },
    }


def device_class(name: str = "gpu.nvidia.com", cel: str = GPU_CEL) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": name},
        "spec": {"selectors": [{"cel": {"expression": cel}}]},
    }


def claim_spec(count: int = 1, cls: str = "gpu.nvidia.com", **extra: Any) -> dict[str, Any]:
    exactly = {"deviceClassName": cls, "allocationMode": "ExactCount", "count": count, **extra}
    return {"devices": {"requests": [{"name": "gpus", "exactly": exactly}]}}


def claim(
    name: str,
    count: int = 1,
    ns: str = "default",
    cls: str = "gpu.nvidia.com",
    allocated: tuple[str, list[str]] | None = None,
    reserved_for: list[str] | None = None,
    spec: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """`allocated`: (node = pool, device names)."""
    obj: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": ns, "uid": f"claim-{ns}-{name}"},
        "spec": spec or claim_spec(count, cls),
    }
    status: dict[str, Any] = {}
    if allocated is not None:
        node, devs = allocated
        status["allocation"] = {
            "devices": {
                "results": [
                    {"request": "gpus", "driver": DRIVER, "pool": node, "device": d} for d in devs
                ]
            },
            "nodeSelector": {
                "nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
                ]
            },
        }
    if reserved_for:
        status["reservedFor"] = [{"resource": "pods", "name": u, "uid": u} for u in reserved_for]
    if status:
        obj["status"] = status
    return obj


def template(
    name: str, count: int = 1, ns: str = "default", cls: str = "gpu.nvidia.com"
) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"spec": claim_spec(count, cls)},
    }


def taint_rule(name: str, pool: str, device: str, effect: str = "NoSchedule") -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceTaintRule",
        "metadata": {"name": name},
        "spec": {
            "deviceSelector": {"driver": DRIVER, "pool": pool, "device": device},
            "taint": {"key": "gpudaemon.io/unhealthy", "value": "xid-79", "effect": effect},
        },
    }


def dra_pod(
    uid: str,
    claims: list[tuple[str, str]],
    node: str = "",
    ns: str = "default",
    statuses: dict[str, str] | None = None,
) -> dict[str, Any]:
    """`claims`: (pod claim name, "claim:<name>" or "template:<name>")."""
    refs = []
    for name, ref in claims:
        kind, _, target = ref.partition(":")
        key = "resourceClaimName" if kind == "claim" else "resourceClaimTemplateName"
        refs.append({"name": name, key: target})
    pod: dict[str, Any] = {
        "metadata": {"uid": uid, "name": uid, "namespace": ns},
        "spec": {
            "nodeName": node,
            "schedulerName": "gpudaemon-scheduler",
            "resourceClaims": refs,
            "containers": [
                {
                    "name": "c",
                    "resources": {
                        "requests": {"cpu": "1"},
                        "claims": [{"name": n} for n, _ in claims],
                    },
                }
            ],
        },
        "status": {"phase": "Pending"},
    }
    if statuses:
        pod["status"]["resourceClaimStatuses"] = [
            {"name": k, "resourceClaimName": v} for k, v in statuses.items()
        ]
    return pod
