"""bench/bodies: what one /filter request body costs the extender in memory (issue 28).

A separate process serves the real ExtenderApi (5,000 nodes in its caches, as
bench/extender fills them) on the real HttpServer; this one sends it ExtenderArgs of
growing size, 1 and N at a time, and reads the server's peak RSS (VmHWM, reset through
/proc/PID/clear_refs before each row). `amplification` is (peak - baseline) divided
by the bytes of the bodies in flight: the figure that sets extender.max_body_bytes and
extender.body_budget_bytes against the chart's memory limit (docs/benchmarks.md).

Bodies: node names only (nodeCacheCapable, what the chart configures), and full Node
objects (without nodeCacheCapable) of about 12 KiB each: labels and annotations as
our agent and GFD write them, 40 container images, conditions, addresses, nodeInfo.

  scripts/bench bodies [--concurrent 4] [--nodes 500,1000,2500,5000]
"""

from __future__ import annotations

import argparse
import http.client
import os
import platform
import random
import subprocess
import sys
import threading
import time
from typing import Any

import orjson

from bench.table import print_table

CLUSTER_NODES = 5000


def full_node(i: int) -> dict[str, Any]:
    """A Node as the API server sends it to an extender without nodeCacheCapable."""
    name = f"node-{i:05d}"
    labels = {f"feature.node.kubernetes.io/cpu-cpuid.{k}": "true" for k in range(40)}
    labels.update({f"nvidia.com/gpu.{k}": f"value-{k}" for k in range(20)})
    labels["kubernetes.io/hostname"] = name
    images = [
        {
            "names": [
                f"registry.example.com/team-{k}/image-{k}@sha256:{'a' * 64}",
                f"registry.example.com/team-{k}/image-{k}:v1.{k}.0",
            ],
            "sizeBytes": 123456789 + k,
        }
        for k in range(40)
    ]
    conds = [
        {
            "type": t,
            "status": "False",
            "lastHeartbeatTime": "2026-11-25T10:00:00Z",
            "lastTransitionTime": "2026-11-20T10:00:00Z",
            "reason": f"Kubelet{t}",
            "message": f"kubelet has no {t.lower()}",
        }
        for t in ("MemoryPressure", "DiskPressure", "PIDPressure", "Ready")
    ]
    alloc = {"cpu": "224", "memory": "2Ti", "nvidia.com/gpu": "8", "pods": "110"}
    return {
        "metadata": {
            "name": name,
            "uid": f"{i:08d}-0000-0000-0000-000000000000",
            "resourceVersion": "123456",
            "labels": labels,
            "annotations": {"gpudaemon.io/gpus": "x" * 1500, "node.alpha/ttl": "0"},
        },
        "spec": {"podCIDR": "10.0.0.0/24", "providerID": f"cloud://{name}"},
        "status": {
            "capacity": alloc,
            "allocatable": alloc,
            "conditions": conds,
            "addresses": [{"type": "InternalIP", "address": "10.0.0.1"}],
            "nodeInfo": {"kubeletVersion": "v1.37.2", "osImage": "Ubuntu 24.04"},
            "images": images,
        },
    }


def pod() -> dict[str, Any]:
    res = {"nvidia.com/gpu": "1", "cpu": "1", "memory": "4Gi"}
    return {
        "metadata": {"name": "bench", "namespace": "default", "uid": ""},
        "spec": {
            "schedulerName": "gpudaemon-scheduler",
            "containers": [{"name": "c", "image": "x", "resources": {"requests": res}}],
        },
    }


def serve(threads: int) -> None:
    """The child: the real app and server, 5,000 nodes cached; prints its port."""
    from prometheus_client import CollectorRegistry

    from bench.extender import filled_cluster
    from gpudaemon.config import load_config
    from gpudaemon.extender.api import ExtenderApi
    from gpudaemon.extender.app import make_policies
    from gpudaemon.httpserver import HttpServer

    cfg = load_config(None, environ={})
    cluster = filled_cluster(CLUSTER_NODES, random.Random(1))
    api = ExtenderApi(
        cluster,
        make_policies(cfg),
        "fragmentation",
        CollectorRegistry(),
        lambda: (True, "ok"),
        candidates=cfg.extender.candidates,
    )
    srv = HttpServer("127.0.0.1:0", api, name="extender", threads=threads, max_body_bytes=1 << 30)
    srv.start()
    print(srv.port, flush=True)
    sys.stdin.read()  # until the parent closes our stdin


def status(pid: int) -> dict[str, int]:
    out = {}
    for line in open(f"/proc/{pid}/status").read().splitlines():  # noqa: SIM115
        k, _, v = line.partition(":")
        if k in ("VmRSS", "VmHWM"):
            out[k] = int(v.split()[0]) << 10
    return out


def post(port: int, body: bytes) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        conn.request("POST", "/filter", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        r.read()
        return r.status
    finally:
        conn.close()


def measure(pid: int, port: int, body: bytes, n: int) -> tuple[float, float]:
    """Peak RSS above the baseline (MiB) with `n` copies of `body` in flight at once."""
    time.sleep(0.5)
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    base = status(pid)["VmRSS"]
    codes: list[int] = []
    gate = threading.Barrier(n)

    def one() -> None:
        gate.wait()
        codes.append(post(port, body))

    t0 = time.perf_counter()
    ts = [threading.Thread(target=one) for _ in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    wall = time.perf_counter() - t0
    assert codes == [200] * n, codes
    return (status(pid)["VmHWM"] - base) / 2**20, wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--concurrent", type=int, default=8, help="requests at once (default 8)")
    ap.add_argument("--nodes", default="500,1000,2500,5000", help="Node objects per body")
    args = ap.parse_args()
    if args.serve:
        serve(args.threads)
        return 0
    child = subprocess.Popen(
        [sys.executable, "-m", "bench.bodies", "--serve", "--threads", str(args.threads)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert child.stdout is not None
        port = int(child.stdout.readline())
        print(
            f"{platform.node()}: {os.cpu_count()} cores, Python {platform.python_version()};"
            f" server threads {args.threads}, {CLUSTER_NODES} nodes cached;"
            f" baseline RSS {status(child.pid)['VmRSS'] / 2**20:.0f} MiB"
        )
        bodies = [("5,000 names (nodeCacheCapable)", orjson.dumps(
            {"Pod": pod(), "NodeNames": [f"node-{i:05d}" for i in range(CLUSTER_NODES)]}
        ))]  # fmt: skip
        for n in (int(x) for x in args.nodes.split(",")):
            items = [full_node(i) for i in range(n)]
            bodies.append(
                (f"{n:,} Node objects", orjson.dumps({"Pod": pod(), "Nodes": {"items": items}}))
            )
        rows = []
        for what, body in bodies:
            mib = len(body) / 2**20
            for n in (1, args.concurrent):
                peak, wall = measure(child.pid, port, body, n)
                rows.append(
                    [what, f"{mib:.2f}", n, f"{peak:.0f}", f"{peak / (mib * n):.1f}", f"{wall:.2f}"]
                )
        print_table(
            ["body", "MiB", "at once", "peak RSS above baseline, MiB", "amplification",
             "wall s"],
            rows,
            "Peak RSS per /filter body (bench/bodies)",
        )  # fmt: skip
    finally:
        if child.stdin is not None:
            child.stdin.close()
        child.wait(10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
