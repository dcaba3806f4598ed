"""Pod attribution through DRA (issue 32): a real gRPC server speaking the kubelet
pod-resources v1 proto answers with containers whose devices come from ResourceClaims
(`dynamic_resources`: driver, pool, device); the agent's ResourceSlice index turns
NVIDIA's devices into GPU and MIG UUIDs, so the GPU's (or MIG device's) series carry
pod, namespace and container exactly as on a device-plugin node. Another driver's
devices and devices missing from the slice are not attributed."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from gpudaemon.agent.cache import Cache
from gpudaemon.agent.metrics.collector import GpuCollector
from gpudaemon.agent.resourceslices import DRIVER, SliceIndex
from gpudaemon.backends.simulated import SimulatedBackend, load_profile
from gpudaemon.model import NodeInventory, PodRef
from gpudaemon.podresources import PodAttribution
from gpudaemon.podresources._gen import api_pb2
from tests.integration.podresources.fake_kubelet import KubeletServer

pytestmark = pytest.mark.integration

NODE = "gpu-node-7"


def dra_pod(name: str, ns: str, container: str, devices: list[tuple[str, str]]) -> Any:
    """A pod whose one container holds `devices` ((driver, device) in our pool) through
    one ResourceClaim, as the kubelet reports it."""
    claim = api_pb2.DynamicResource(
        claim_name=f"{name}-gpus",
        claim_namespace=ns,
        claim_resources=[
            api_pb2.ClaimResource(
                driver_name=driver,
                pool_name=NODE,
                device_name=device,
                cdi_devices=[api_pb2.CDIDevice(name=f"k8s.{driver}/claim={device}")],
            )
            for driver, device in devices
        ],
    )
    return api_pb2.PodResources(
        name=name,
        namespace=ns,
        containers=[api_pb2.ContainerResources(name=container, dynamic_resources=[claim])],
    )


def attr(kind: str, value: str) -> dict[str, str]:
    return {kind: value}


class Slices:
    """The API server's answer for our node's ResourceSlices (as NVIDIA's driver
    publishes them: `gpu-<minor>`, MIG devices `gpu-<minor>-mig-...`)."""

    def __init__(self, inv: NodeInventory) -> None:
        devices: list[dict[str, Any]] = []
        for g in inv.gpus:
            devices.append({"name": f"gpu-{g.index}", "attributes": {
                "type": attr("string", "gpu"), "uuid": attr("string", g.uuid)}})  # fmt: skip
            for j, m in enumerate(g.mig_devices):
                devices.append({"name": f"gpu-{g.index}-mig-{j}", "attributes": {
                    "type": attr("string", "mig"), "uuid": attr("string", m.uuid),
                    "parentUUID": attr("string", g.uuid)}})  # fmt: skip
        self.items = [{"metadata": {"name": f"{NODE}-{DRIVER}"},
                       "spec": {"driver": DRIVER, "nodeName": NODE, "devices": devices,
                                "pool": {"name": NODE, "generation": 1,
                                         "resourceSliceCount": 1}}}]  # fmt: skip
        self.lists = 0

    def list_items(
        self, path: str, query: Mapping[str, str] | None = None, page_size: int = 500
    ) -> tuple[list[dict[str, Any]], str]:
        self.lists += 1
        assert query == {"fieldSelector": f"spec.nodeName={NODE}"}
        return self.items, "1"


def test_claims_attribute_gpus_and_mig_devices_to_their_series(kubelet: KubeletServer) -> None:
    backend = SimulatedBackend(load_profile("a100-mig"), seed=0)
    inv = backend.inventory()
    gpu3 = inv.gpus[3]
    mig_gpu = next(g for g in inv.gpus if g.mig_devices)
    mig_j = 1
    mig = mig_gpu.mig_devices[mig_j]
    slices = Slices(inv)
    index = SliceIndex(slices, NODE)
    kubelet.servicer.pods = [
        dra_pod("train", "ml", "main", [(DRIVER, f"gpu-{gpu3.index}")]),
        dra_pod("infer", "serving", "srv", [(DRIVER, f"gpu-{mig_gpu.index}-mig-{mig_j}")]),
        dra_pod("nic", "net", "c", [("example.com/nic", "gpu-0")]),
        dra_pod("ghost", "ml", "c", [(DRIVER, "gpu-99")]),
    ]
    pods = PodAttribution(str(kubelet.socket), dra_device_uuid=index.uuid_of)
    pods.refresh()
    assert dict(pods.get()) == {
        gpu3.uuid: PodRef("train", "ml", "main"),
        mig.uuid: PodRef("infer", "serving", "srv"),
    }

    cache = Cache()
    cache.put_inventory(inv)
    cache.put_samples(backend.sample())
    reg = CollectorRegistry()
    reg.register(GpuCollector(cache, NODE, pods=pods.get))
    fams = {f.name: f for f in reg.collect()}
    owned = [s for s in fams["gpudaemon_gpu_healthy"].samples if s.labels["pod"]]
    assert [(s.labels["gpu"], s.labels["pod"], s.labels["container"]) for s in owned] == [
        (str(gpu3.index), "train", "main")
    ]
    migs = [s for s in fams["gpudaemon_mig_memory_total_bytes"].samples if s.labels["pod"]]
    assert [(s.labels["mig_uuid"], s.labels["namespace"]) for s in migs] == [(mig.uuid, "serving")]

    # The miss (gpu-99) re-reads the slices at most once per period, not per refresh.
    before = slices.lists
    for _ in range(5):
        pods.refresh()
    assert slices.lists == before


def test_without_the_slice_index_claims_are_not_attributed(kubelet: KubeletServer) -> None:
    inv = SimulatedBackend(load_profile("dgx-h100"), seed=0).inventory()
    kubelet.servicer.pods = [dra_pod("train", "ml", "main", [(DRIVER, "gpu-0")])]
    pods = PodAttribution(str(kubelet.socket))
    pods.refresh()
    assert dict(pods.get()) == {}
    index = SliceIndex(Slices(inv), NODE)
    pods = PodAttribution(str(kubelet.socket), dra_device_uuid=index.uuid_of)
    pods.refresh()
    assert dict(pods.get()) == {inv.gpus[0].uuid: PodRef("train", "ml", "main")}
