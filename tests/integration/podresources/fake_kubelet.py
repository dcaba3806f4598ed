"""A kubelet stand-in: a real gRPC server implementing the upstream pod-resources v1
proto (the generated stubs the agent uses) on a unix socket. Shared by the
pod-resources and Prometheus integration tests."""

from __future__ import annotations

from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from gpudaemon.podresources._gen import api_pb2, api_pb2_grpc


def pod(name: str, namespace: str, *containers: tuple[str, dict[str, list[str]]]) -> Any:
    """PodResources with containers given as (name, {resource_name: [device ids]})."""
    return api_pb2.PodResources(
        name=name,
        namespace=namespace,
        containers=[
            api_pb2.ContainerResources(
                name=cname,
                devices=[
                    api_pb2.ContainerDevices(resource_name=res, device_ids=ids)
                    for res, ids in devs.items()
                ],
                cpu_ids=[2, 3],
            )
            for cname, devs in containers
        ],
    )


class FakeKubelet(api_pb2_grpc.PodResourcesListerServicer):  # type: ignore[misc]
    def __init__(self) -> None:
        self.pods: list[Any] = []
        self.calls = 0
        self.fail = False

    def List(self, request: Any, context: Any) -> Any:
        self.calls += 1
        if self.fail:
            context.abort(grpc.StatusCode.INTERNAL, "kubelet is unwell")
        return api_pb2.ListPodResourcesResponse(pod_resources=self.pods)


class KubeletServer:
    def __init__(self, socket_path: Path) -> None:
        self.socket = socket_path
        self.servicer = FakeKubelet()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        api_pb2_grpc.add_PodResourcesListerServicer_to_server(self.servicer, self._server)
        self._server.add_insecure_port(f"unix:{socket_path}")
        self._server.start()

    def stop(self) -> None:
        self._server.stop(grace=None).wait()
