"""bench/extender's DRA rows: /filter and /prioritize over a real socket with every
node's GPUs published in a ResourceSlice (NVIDIA's driver's layout, 8 devices a node),
a third of them allocated to claims already, the DeviceClasses, and one unallocated
claim per measured pod (1, 2, 4 or 8 GPUs) in the caches: what a DRA cluster costs the
extender beside the device-plugin rows (same table, policy "<name> (DRA)")."""

from __future__ import annotations

import http.client
import random
import time
from collections.abc import Callable
from typing import Any

import orjson
from prometheus_client import CollectorRegistry

from gpudaemon.cluster.clusterstate import ClusterState
from gpudaemon.cluster.policies.base import Policy
from gpudaemon.cluster.state import PodShape
from gpudaemon.extender.api import ExtenderApi
from gpudaemon.httpserver import HttpServer
from tests.dra_objects import MIG_CEL, claim, device_class, dra_pod, nvidia_slice
from tests.kubeobjects import lease_obj, node_obj


def dra_cluster(
    n: int, requests: int, rng: random.Random, meta: list[tuple[dict[str, str], dict[str, str]]]
) -> ClusterState:
    c = ClusterState("gpudaemon.io/", dra=True)
    nodes, slices, claims = [], [], []
    for i in range(n):
        name = f"node-{i:05d}"
        labels, ann = meta[i % len(meta)]
        node = node_obj(name, labels, ann)
        node["status"]["allocatable"] = {k: v for k, v in node["status"]["allocatable"].items()
                                         if k != "nvidia.com/gpu"}  # fmt: skip
        nodes.append(node)
        slices.append(nvidia_slice(name))
        used = 0
        for j in range(rng.randint(0, 3)):  # ~a third of the devices allocated
            k = rng.choice([1, 1, 2])
            devs = [f"gpu-{d}" for d in range(used, used + k)]
            used += k
            claims.append(claim(f"{name}-c{j}", k, allocated=(name, devs), reserved_for=[f"u{j}"]))
    for k in range(requests + 20):
        claims.append(claim(f"want-{k}", rng.choice([1, 2, 4, 8])))
    c.replace_nodes(nodes)
    c.replace_leases([lease_obj(f"node-{i:05d}", f"node-{i:05d}") for i in range(n)])
    c.dra_replace("deviceclasses")([device_class(), device_class("mig.nvidia.com", MIG_CEL)])
    c.dra_replace("resourceslices")(slices)
    c.dra_replace("resourceclaims")(claims)
    return c


def dra_rows(
    n: int,
    requests: int,
    rng: random.Random,
    policies: dict[str, Policy],
    candidates: int,
    meta: list[tuple[dict[str, str], dict[str, str]]],
    pct: Callable[[list[float], float], float],
) -> list[list[str]]:
    cluster = dra_cluster(n, requests, rng, meta)
    names = [f"node-{i:05d}" for i in range(n)]
    rows = []
    probe = dra_pod("", [("gpus", "claim:want-0")])
    assert cluster.with_dra(probe, PodShape(gpus=0)).gpus > 0  # judged by its claim
    for policy in ("binpack", "fragmentation"):
        api = ExtenderApi(cluster, policies, policy, CollectorRegistry(), lambda: (True, "ok"),
                          candidates=candidates)  # fmt: skip
        server = HttpServer("127.0.0.1:0", api, name="extender", max_body_bytes=64 << 20)
        server.start()
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        for verb in ("filter", "prioritize"):
            times: list[float] = []
            body = b""
            for k in range(requests + 20):
                pod: dict[str, Any] = dra_pod("", [("gpus", f"claim:want-{k}")])
                body = orjson.dumps({"Pod": pod, "NodeNames": names})
                t0 = time.perf_counter()
                conn.request("POST", f"/{verb}", body, {"Content-Type": "application/json"})
                resp = conn.getresponse()
                data = resp.read()
                dt = time.perf_counter() - t0
                assert resp.status == 200, data[:200]
                if k >= 20:
                    times.append(dt * 1000)
            p50, p99, top = pct(times, 50), pct(times, 99), max(times)
            rows.append([f"{n}", f"{policy} (DRA)", verb, f"{p50:.2f}", f"{p99:.2f}",
                         f"{top:.2f}", f"{len(body) / 1024:.0f}"])  # fmt: skip
        conn.close()
        server.stop()
    return rows
