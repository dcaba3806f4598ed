"""DRA pods through gpudaemon-scheduler and the extender, against real servers (issue 32).

1. Four nodes with 8 GPU devices each in ResourceSlices (as NVIDIA's driver publishes
   them, with the UUIDs the agents report); two nodes partly used by claims already
   allocated. Twelve pods asking for 1, 2 or 4 GPUs through ResourceClaimTemplates,
   created in a burst: every claim is allocated on a node the extender approved for
   that pod; the partly used nodes fill first and one whole node is left whole, as
   bin-packing predicts; no node has more than 8 devices allocated, none twice.
2. A running Deployment pod holds a GPU through its claim; that GPU gets XID 79 on its
   agent: the rebalancer (dra on) asks the eviction API, a PDB refuses it, and once the
   PDB goes the pod is evicted and replaced.
3. A node's pool published in two generations (the driver republishing it) counts
   once, as kube-scheduler counts it: the extender's /filter does not pass a 9-GPU
   claim on that 8-GPU node, and an 8-GPU claim pod binds there.
"""

from __future__ import annotations

import contextlib
import json
import threading
import urllib.request
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from gpudaemon.backends.simulated import FaultSpec, SimulatedBackend
from gpudaemon.errors import KubeError
from tests.dra_objects import MIG_CEL, device_class, gpu_device
from tests.integration.rebalancer.rig import RebalanceRig, metric
from tests.integration.scheduler.rig import GROUP, NS
from tests.support import wait_for

pytestmark = pytest.mark.integration

R = "/apis/resource.k8s.io/v1"
EVICTIONS = "gpudaemon_rebalancer_evictions_total"
NODES = ["dra-a", "dra-b", "dra-c", "dra-d"]


def publish_slice(rig: RebalanceRig, node: str, generation: int = 1) -> dict[str, int]:
    """The node's ResourceSlice as NVIDIA's driver writes it, from its agent's GPUs;
    returns device name -> GPU index. A later `generation` is a second slice beside
    the first, as while the driver replaces its pool."""
    inv = wait_for(lambda: rig.agents[node].cache.get().inventory, 30, what=f"{node} inventory")
    devices = []
    for g in inv.gpus:
        d = gpu_device(node, g.index)
        d["attributes"]["uuid"] = {"string": g.uuid}
        devices.append(d)
    rig.cp.admin.request("POST", f"{R}/resourceslices", body={
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-gpu.nvidia.com" + (f"-{generation}" if generation > 1 else "")},
        "spec": {"driver": "gpu.nvidia.com", "nodeName": node,
                 "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
                 "devices": devices}})  # fmt: skip
    return {f"gpu-{g.index}": g.index for g in inv.gpus}


def template(rig: RebalanceRig, name: str, count: int) -> None:
    body = {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
        "metadata": {"name": name},
        "spec": {"spec": {"devices": {"requests": [{"name": "gpus", "exactly": {
            "deviceClassName": "gpu.nvidia.com", "allocationMode": "ExactCount",
            "count": count}}]}}},
    }  # fmt: skip
    rig.cp.admin.request("POST", f"{R}/namespaces/{NS}/resourceclaimtemplates", body=body)


def pod_spec(template_name: str, scheduler: str, selector: Mapping[str, str]) -> dict[str, Any]:
    return {
        "schedulerName": scheduler,
        "nodeSelector": dict(selector),
        "terminationGracePeriodSeconds": 0,
        "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": template_name}],
        "containers": [{"name": "c", "image": "example.invalid/x",
                        "resources": {"requests": {"cpu": "100m"}, "claims": [{"name": "gpus"}]}}],
    }  # fmt: skip


def create_pod(rig: RebalanceRig, name: str, spec: dict[str, Any]) -> None:
    rig.cp.admin.request("POST", f"/api/v1/namespaces/{NS}/pods", body={
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec})  # fmt: skip


def claims(rig: RebalanceRig) -> list[dict[str, Any]]:
    return list(rig.cp.admin.request("GET", f"{R}/namespaces/{NS}/resourceclaims")["items"])


def allocated_on(c: Mapping[str, Any]) -> tuple[str, list[str]] | None:
    alloc = (c.get("status") or {}).get("allocation")
    if not alloc:
        return None
    results = alloc["devices"]["results"]
    return results[0]["pool"], [r["device"] for r in results]


def claim_of(rig: RebalanceRig, pod: str) -> dict[str, Any] | None:
    p = rig.pod(pod)
    names = [
        s.get("resourceClaimName") for s in p.get("status", {}).get("resourceClaimStatuses") or []
    ]
    return next((c for c in claims(rig) if c["metadata"]["name"] in names), None)


class Approvals:
    """What the in-process extender's /filter passed, by pod name (and the GPUs it saw
    the pod ask for): the claim must be allocated on one of those nodes."""

    def __init__(self, rig: RebalanceRig) -> None:
        assert rig.extender is not None
        fw = rig.extender.api.framework
        self.passed: dict[str, set[str]] = {}
        self.gpus: dict[str, int] = {}
        self._lock = threading.Lock()
        real = fw.filter

        def filter(pod: Mapping[str, Any], names: Sequence[str]) -> Any:
            res = real(pod, names)
            name = str((pod.get("metadata") or {}).get("name"))
            with self._lock:
                self.passed.setdefault(name, set()).update(res.passed)
                self.gpus[name] = fw.shape(pod).gpus
            return res

        fw.filter = filter  # type: ignore[method-assign]


def test_dra_pods_pack_as_binpack_predicts(rig: RebalanceRig) -> None:
    for n in NODES:
        rig.add_node(n, "dra", gpus=0)
        rig.live_agent(n)
    rig.wait_extender_sees(NODES)
    for cls in (device_class(), device_class("mig.nvidia.com", MIG_CEL)):
        rig.cp.admin.request("POST", f"{R}/deviceclasses", body=cls)
    for n in NODES:
        publish_slice(rig, n)
    ext = rig.extender
    assert ext is not None
    wait_for(lambda: all((s := ext.cluster.states([n])[n]) is not None and s.gpus_free == 8
                         for n in NODES), 30, what="the extender to count 8 free devices a node")  # fmt: skip

    # Two nodes partly used: claims allocated by the default scheduler, pinned there.
    for count in (1, 2, 3, 4, 5):
        template(rig, f"t{count}", count)
    for node, count in (("dra-a", 3), ("dra-b", 5)):
        create_pod(rig, f"filler-{node}", pod_spec(f"t{count}", "default-scheduler",
                                                   {"kubernetes.io/hostname": node}))  # fmt: skip
    for node in ("dra-a", "dra-b"):
        wait_for(lambda node=node: rig.pod(f"filler-{node}")["spec"].get("nodeName"), 60,
                 what=f"the filler on {node} bound")  # fmt: skip
    wait_for(lambda: [s.gpus_free for s in ext.cluster.states(NODES).values()] == [5, 3, 8, 8],  # type: ignore[union-attr]
             30, what="the extender to count the fillers' allocations")  # fmt: skip

    approvals = Approvals(rig)
    sizes = [4, 2, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]  # 16 GPUs: the 8 free on a, b and one whole node
    names = [f"w{i}-{s}-{uuid.uuid4().hex[:4]}" for i, s in enumerate(sizes)]
    for name, s in zip(names, sizes, strict=True):
        create_pod(rig, name, pod_spec(f"t{s}", "gpudaemon-scheduler", {GROUP: "dra"}))

    def all_bound() -> dict[str, str] | None:
        placed = {n: rig.pod(n)["spec"].get("nodeName") for n in names}
        return placed if all(placed.values()) else None

    placed = wait_for(all_bound, 180, interval=0.5, what="the twelve DRA pods bound")

    used = {n: set() for n in NODES}  # type: dict[str, set[str]]
    count = {n: 0 for n in NODES}
    for c in claims(rig):
        a = allocated_on(c)
        if a is not None:
            assert not used[a[0]] & set(a[1]), f"a device allocated twice on {a[0]}"
            used[a[0]] |= set(a[1])
            count[a[0]] += len(a[1])
    for name, size in zip(names, sizes, strict=True):
        c = claim_of(rig, name)
        assert c is not None
        a = allocated_on(c)
        assert a is not None and a[0] == placed[name] and len(a[1]) == size
        assert placed[name] in approvals.passed[name], (name, approvals.passed.get(name))
    assert all(v <= 8 for v in count.values()), count
    assert count["dra-a"] == 8 and count["dra-b"] == 8, count  # partly used nodes first
    assert sorted([count["dra-c"], count["dra-d"]]) == [0, 8], count  # one node kept whole
    # The extender judged each pod by its claim's GPUs.
    assert [approvals.gpus[n] for n in names] == sizes


def test_a_pod_on_a_sick_gpu_through_a_claim_is_drained(rig: RebalanceRig) -> None:
    free = next(n for n in ("dra-c", "dra-d") if not any(
        (a := allocated_on(c)) and a[0] == n for c in claims(rig)))  # fmt: skip
    labels = {"app": "dra-trainer"}
    rig.cp.admin.request("POST", f"/apis/apps/v1/namespaces/{NS}/deployments", body={
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "dra-trainer"},
        "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                 "template": {"metadata": {"labels": labels},
                              "spec": pod_spec("t1", "gpudaemon-scheduler",
                                               {"kubernetes.io/hostname": free})}}})  # fmt: skip

    def running() -> tuple[str, dict[str, Any]] | None:
        for p in rig.pods("app=dra-trainer"):
            if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp"):
                c = claim_of(rig, p["metadata"]["name"])
                if c is not None and allocated_on(c):
                    return p["metadata"]["name"], c
        return None

    name, c = wait_for(running, 120, what="the trainer running with its claim allocated")
    node, [device] = allocated_on(c)  # type: ignore[misc]
    assert node == free
    index = int(device.removeprefix("gpu-"))
    backend = rig.agents[node].backend
    assert isinstance(backend, SimulatedBackend)
    backend.inject(index, FaultSpec(kind="xid", xid=79))

    rig.cp.admin.request("POST", f"/apis/policy/v1/namespaces/{NS}/poddisruptionbudgets", body={
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "dra-trainer"},
        "spec": {"maxUnavailable": 0, "selector": {"matchLabels": labels}}})  # fmt: skip
    url = rig.start_rebalancer("dra", apply=True, dra=True, grace_s=0)
    wait_for(lambda: metric(url, EVICTIONS, kind="drain", result="refused_pdb") >= 1, 90,
             what="the eviction refused by the PDB")  # fmt: skip
    assert rig.pod(name)["spec"]["nodeName"] == node  # still there
    rig.delete(f"/apis/policy/v1/namespaces/{NS}/poddisruptionbudgets/dra-trainer")

    def evicted() -> bool:
        try:
            p = rig.pod(name)
        except KubeError:
            return True
        return bool(p["metadata"].get("deletionTimestamp"))

    wait_for(evicted, 90, what="the trainer evicted")
    assert metric(url, EVICTIONS, kind="drain", result="done") == 1
    assert any(e["reason"] == "RebalanceEvicted" for e in rig.events(name))
    wait_for(lambda: any(p["metadata"]["name"] != name for p in rig.pods("app=dra-trainer")),
             60, what="a replacement pod")  # fmt: skip
    rig.stop_rebalancers()


def extender_filter(rig: RebalanceRig, pod: Mapping[str, Any], nodes: list[str]) -> Any:
    """The extender's /filter over HTTP, as kube-scheduler calls it."""
    assert rig.extender is not None
    req = urllib.request.Request(
        f"http://127.0.0.1:{rig.extender.server.port}/filter",
        data=json.dumps({"Pod": pod, "NodeNames": nodes}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def test_a_pool_in_two_generations_counts_once(rig: RebalanceRig) -> None:
    node = "dra-gen"
    rig.add_node(node, "dragen", gpus=0)
    rig.live_agent(node)
    rig.wait_extender_sees([node])
    with contextlib.suppress(KubeError):  # the first test made it already
        rig.cp.admin.request("POST", f"{R}/deviceclasses", body=device_class())
    publish_slice(rig, node, generation=1)
    publish_slice(rig, node, generation=2)
    sliced = rig.cp.admin.request("GET", f"{R}/resourceslices")["items"]
    assert len([s for s in sliced if s["spec"]["nodeName"] == node]) == 2  # both generations
    ext = rig.extender
    assert ext is not None
    wait_for(lambda: (s := ext.cluster.states([node])[node]) is not None and s.gpus_free == 8,
             30, what="the extender to count 8 free devices on the node")  # fmt: skip
    for count in (8, 9):
        template(rig, f"gen-t{count}", count)

    # 9 GPUs: kube-scheduler's own DRA filter refuses it; so does the extender's /filter.
    create_pod(rig, "gen-nine", pod_spec("gen-t9", "gpudaemon-scheduler", {GROUP: "dragen"}))
    nine = rig.pod("gen-nine")
    res = extender_filter(rig, nine, [node])
    passed = res.get("NodeNames") or res.get("nodeNames") or []
    assert node not in passed and node in (res.get("FailedNodes") or res.get("failedNodes")), res

    # 8 GPUs: passed, and it binds there with all 8 devices of the newest generation.
    create_pod(rig, "gen-eight", pod_spec("gen-t8", "gpudaemon-scheduler", {GROUP: "dragen"}))
    res = extender_filter(rig, rig.pod("gen-eight"), [node])
    assert node in (res.get("NodeNames") or res.get("nodeNames") or []), res
    bound = wait_for(lambda: rig.pod("gen-eight")["spec"].get("nodeName"), 60,
                     what="the 8-GPU claim pod bound")  # fmt: skip
    assert bound == node
    c = wait_for(lambda: (c := claim_of(rig, "gen-eight")) and allocated_on(c) and c, 30,
                 what="its claim allocated")  # fmt: skip
    pool, devices = allocated_on(c)  # type: ignore[misc]
    assert pool == node and sorted(devices) == sorted(f"gpu-{i}" for i in range(8))
    assert not rig.pod("gen-nine")["spec"].get("nodeName")  # still pending
    wait_for(lambda: (s := ext.cluster.states([node])[node]) is not None and s.gpus_free == 0,
             30, what="the extender to count the node full")  # fmt: skip
    for name in ("gen-nine", "gen-eight"):
        rig.delete(f"/api/v1/namespaces/{NS}/pods/{name}")
