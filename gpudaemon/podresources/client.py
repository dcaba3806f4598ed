"""The one module that talks to the kubelet pod-resources API (v1 `List`).

gRPC errors are wrapped into PodResourcesError here, so nothing else sees grpc types.
grpc and the generated stubs are imported at the first call, that is once the kubelet's
socket is there: grpc's core is ~11 MiB of RSS that an agent without the socket (a
laptop, a node without the mount) never needs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from gpudaemon.errors import PodResourcesError
from gpudaemon.model import PodMap, PodRef

# nvidia.com/gpu carries GPU UUIDs (or MIG UUIDs with the "single" MIG strategy);
# the "mixed" strategy names one resource per MIG profile, nvidia.com/mig-1g.10gb.
GPU_RESOURCE = "nvidia.com/gpu"
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"
# The kubelet answers List from memory; a slow answer means it is in trouble.
DEFAULT_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class Assignment:
    """One device id assigned to one container."""

    device_id: str
    resource: str
    ref: PodRef


def list_pod_resources(socket_path: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[Assignment]:
    """Call List once on a fresh channel and flatten the answer to GPU assignments."""
    import grpc

    from gpudaemon.podresources._gen import api_pb2, api_pb2_grpc

    try:
        with grpc.insecure_channel(f"unix://{socket_path}") as channel:
            stub = api_pb2_grpc.PodResourcesListerStub(channel)
            resp = stub.List(api_pb2.ListPodResourcesRequest(), timeout=timeout_s)
    except grpc.RpcError as e:
        code = e.code().name if hasattr(e, "code") else "UNKNOWN"
        detail = e.details() if hasattr(e, "details") else str(e)
        raise PodResourcesError(f"pod-resources List on {socket_path}: {code}: {detail}") from e
    return list(_assignments(resp.pod_resources))


def _assignments(pods: Iterable[Any]) -> Iterable[Assignment]:
    """From api_pb2.PodResources messages."""
    for pod in pods:
        for ctr in pod.containers:
            for dev in ctr.devices:
                if not is_gpu_resource(dev.resource_name):
                    continue
                for raw in dev.device_ids:
                    yield Assignment(
                        device_id=_physical_id(raw),
                        resource=dev.resource_name,
                        ref=PodRef(pod=pod.name, namespace=pod.namespace, container=ctr.name),
                    )


def is_gpu_resource(name: str) -> bool:
    return name == GPU_RESOURCE or name.startswith(MIG_RESOURCE_PREFIX)


def _physical_id(device_id: str) -> str:
    # With time-slicing the device plugin advertises replicas as "GPU-<uuid>::<n>".
    return device_id.split("::", 1)[0]


def device_map(assignments: Iterable[Assignment]) -> PodMap:
    """GPU/MIG UUID -> container. A shared (time-sliced) GPU goes to the first container
    in namespace/pod/container order, so the label does not flap between scrapes."""
    out: dict[str, PodRef] = {}
    for a in sorted(
        assignments, key=lambda a: (a.ref.namespace, a.ref.pod, a.ref.container, a.device_id)
    ):
        out.setdefault(a.device_id, a.ref)
    return out
