"""bench/quarantine: fault to quarantine at fleet scale, against a real kube-apiserver.

`--nodes` plain Node objects (default 1,000) and one simulated agent per node
(bench/simagent.py: the agent's own poller, labeler and NodeLabelSink, the agent's
restricted identity, the taint on). Every agent does its first cycle (labels,
annotation, Lease). Then `--faults` of them (default 150) get XID 79 on one GPU in the
same second. Each faulted agent runs the agent's own fast path: its simulated backend's
XID event loop (the same loop as NVML's) wakes its `Quarantine`, which polls and runs
the label reconcile out of turn, on the agent's own connection. The other agents stay
idle during the burst (their steady writes are bench/apiwrites'), so every write the
API server counts in the window is the quarantine's.

It reports, per faulted node, fault (the moment XID 79 was injected) to the Node showing
all three (label `gpu.unhealthy=1`, condition `GPUHealthy=False`, taint
`gpu-unhealthy:NoSchedule`), seen by a watch: p50, p99 and worst; kube-apiserver's own
write latency p99 during the burst (apiserver_request_duration_seconds, Node writes);
and Node writes per faulted node (apiserver_request_total).

  scripts/bench quarantine [--nodes 1000] [--faults 150] [--workers 16]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import ssl
import statistics
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from loguru import logger
from prometheus_client.parser import text_string_to_metric_families

from bench.extender import cpu_s
from bench.fleet import bare_node
from bench.simagent import SimAgent
from bench.table import print_table
from gpudaemon.agent.quarantine import Quarantine
from gpudaemon.backends.simulated import FaultSpec
from gpudaemon.kube.client import Credentials, KubeClient
from tests.integration.kube.controlplane import RBAC, ControlPlane
from tests.kubeobjects import quarantined
from tests.support import tools_bin

P = "gpudaemon.io/"
WRITES = ("PATCH", "APPLY", "UPDATE", "POST", "CREATE")


def server_metrics(cp: ControlPlane) -> tuple[float, dict[float, float]]:
    """kube-apiserver's Node writes so far, and its write-latency histogram buckets."""
    ctx = ssl.create_default_context(cafile=str(cp.ca))
    req = urllib.request.Request(
        f"{cp.server}/metrics", headers={"Authorization": "Bearer admin-token"}
    )
    with urllib.request.urlopen(req, context=ctx, timeout=30) as resp:
        text = resp.read().decode()
    writes = 0.0
    buckets: dict[float, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.labels.get("resource") != "nodes" or s.labels.get("verb") not in WRITES:
                continue
            if s.name == "apiserver_request_total":
                writes += s.value
            elif s.name == "apiserver_request_duration_seconds_bucket":
                le = float(s.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + s.value
    return writes, buckets


def p99_from(before: dict[float, float], after: dict[float, float]) -> float:
    """The 99th percentile of the burst's write latency: the upper bound of the bucket
    that holds it (Prometheus' own reading of a histogram, without interpolation)."""
    diff = sorted((le, after.get(le, 0.0) - before.get(le, 0.0)) for le in after)
    total = diff[-1][1] if diff else 0.0
    for le, n in diff:
        if total and n >= 0.99 * total:
            return le
    return float("nan")


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--faults", type=int, default=150)
    ap.add_argument("--workers", type=int, default=16)
    args = ap.parse_args()
    if not 0 < args.faults <= args.nodes:
        print("bench/quarantine: --faults must be between 1 and --nodes", file=sys.stderr)
        return 2
    logger.remove()
    logger.add(sys.stderr, level="ERROR")

    cp = ControlPlane(tools_bin("k8s", "etcd"))
    agents: list[SimAgent] = []
    quarantines: list[Quarantine] = []
    stop = threading.Event()
    try:
        cp.start()
        cp.apply_manifest(RBAC)
        admin = cp.admin
        names = [f"gpu-{i:05d}" for i in range(args.nodes)]
        pool = ThreadPoolExecutor(args.workers)
        list(pool.map(lambda n: admin.request("POST", "/api/v1/nodes", body=bare_node(n)), names))
        shared = KubeClient.from_credentials(
            Credentials(False, str(cp.agent_kubeconfig)), timeout_s=30
        )
        faulted = set(random.Random(1).sample(range(args.nodes), args.faults))
        for i, n in enumerate(names):
            # A faulted agent has its own connection, as every real agent does.
            client = (
                KubeClient.from_credentials(
                    Credentials(False, str(cp.agent_kubeconfig)), timeout_s=30
                )
                if i in faulted
                else shared
            )
            agents.append(SimAgent(n, cp.agent_kubeconfig, seed=i, clock=time.time,
                                   client=client, taint=True))  # fmt: skip
        t_first = time.monotonic()
        errors = list(pool.map(lambda a: a.run_once(), agents)).count(False)
        first_s = time.monotonic() - t_first
        sick = [agents[i] for i in sorted(faulted)]
        own: list[float] = []  # each agent's own view: XID event to its writes done
        for a in sick:
            q = Quarantine(
                observe=lambda trigger, seconds: own.append(seconds),
                poll=lambda a=a: a.run("telemetry"),
                reconcile=lambda a=a: a.run("labels"),
                unhealthy=lambda a=a: frozenset(
                    s.uuid for s in a.cache.get().samples if not s.healthy
                ),
            )
            q.published(frozenset())  # the first reconcile published a healthy node
            a.backend.subscribe(q.on_xid)
            q.start()
            quarantines.append(q)

        # A watch of every Node: when each faulted one shows all three.
        seen: dict[str, float] = {}
        rv = admin.request("GET", "/api/v1/nodes", query={"limit": "1"})["metadata"][
            "resourceVersion"
        ]
        sick_names = {a.cfg.node_name for a in sick}

        def watch() -> None:
            nonlocal rv
            client = cp.admin
            while not stop.is_set() and len(seen) < len(sick_names):
                for _, obj in client.watch("/api/v1/nodes", rv, timeout_s=10):
                    rv = obj["metadata"].get("resourceVersion", rv)
                    name = obj["metadata"].get("name")
                    if name in sick_names and name not in seen and quarantined(obj):
                        seen[name] = time.monotonic()
                    if stop.is_set() or len(seen) == len(sick_names):
                        return

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        time.sleep(1.0)
        writes0, buckets0 = server_metrics(cp)
        assert cp.apiserver is not None and cp.etcd is not None
        cpu0 = (time.process_time(), cpu_s(cp.apiserver.pid), cpu_s(cp.etcd.pid))
        injected: dict[str, float] = {}
        rng = random.Random(2)
        for a in sick:  # the same second
            injected[a.cfg.node_name] = time.monotonic()
            a.backend.inject(rng.randrange(8), FaultSpec(kind="xid", xid=79))
        watcher.join(timeout=60)
        burst_s = time.monotonic() - min(injected.values())
        cpu1 = (time.process_time(), cpu_s(cp.apiserver.pid), cpu_s(cp.etcd.pid))
        agents_cpu, api_cpu, etcd_cpu = (b - a for a, b in zip(cpu0, cpu1, strict=True))
        time.sleep(1.0)  # writes still in flight are counted
        writes1, buckets1 = server_metrics(cp)
        delays = [seen[n] - injected[n] for n in seen]
        missing = len(sick_names) - len(seen)
        rows = [
            ("nodes / faulted in the same second", f"{args.nodes} / {args.faults}"),
            ("first cycle of every agent (s)", f"{first_s:.1f} ({errors} failed)"),
            ("fault -> Node quarantined, p50 (s)", f"{statistics.median(delays):.3f}"),
            ("fault -> Node quarantined, p99 (s)", f"{pct(delays, 0.99):.3f}"),
            ("fault -> Node quarantined, worst (s)", f"{max(delays):.3f}"),
            ("faulted nodes never quarantined", f"{missing}"),
            ("the agents' own view (XID event -> writes done), p50 / p99 (s)",
             f"{statistics.median(own):.3f} / {pct(own, 0.99):.3f}" if own else "-"),
            ("kube-apiserver Node write latency p99 in the burst (s, bucket bound)",
             f"{p99_from(buckets0, buckets1):g}"),
            ("Node writes per faulted node", f"{(writes1 - writes0) / args.faults:.2f}"),
            ("CPU s from the fault to the last quarantine: agents (this process) /"
             " kube-apiserver / etcd (wall s)",
             f"{agents_cpu:.2f} / {api_cpu:.2f} / {etcd_cpu:.2f} ({burst_s:.2f})"),
            ("CPU ms per faulted node: agent / kube-apiserver + etcd",
             f"{agents_cpu / args.faults * 1e3:.1f} / "
             f"{(api_cpu + etcd_cpu) / args.faults * 1e3:.1f}"),
            ("machine", f"{platform.node()} {os.cpu_count()} cpu, {platform.python_version()}"),
        ]  # fmt: skip
        print_table(
            ("metric", "value"), rows, f"bench/quarantine  {time.strftime('%Y-%m-%d %H:%M')}"
        )
        return 0 if missing == 0 else 1
    finally:
        stop.set()
        for q in quarantines:
            q.stop()
        for a in agents:
            a.backend.close()
        cp.stop()


if __name__ == "__main__":
    sys.exit(main())
