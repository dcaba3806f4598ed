"""bench/apiwrites: API-server load of a fleet of agents, against a real kube-apiserver.

Runs N simulated agents (bench/simagent.py: the agent's poller, labeler and NodeLabelSink
with the agent's restricted identity, one
process, one shared simulated clock) for M simulated minutes on the default schedules
(telemetry 5 s, label reconcile 30 s, Lease renewal every `renew_period_s` of the
configured duration: 360 s -> every 120 s). Watches on Nodes and on the agents' Leases
count the writes the API server really made (MODIFIED events), next to the sinks' own
node_writes counters, and the table gives both kinds and their sum per node-hour
(target: at most 60, Node and Lease together), and the Node reads kube-apiserver counted
per node-minute (target: at most 0.5). Optionally a few agents lose a GPU halfway, to show a
real change still reaches the Node. Prints a table.

  scripts/bench apiwrites [--nodes 200] [--minutes 10] [--warmup 0] [--lost 2] [--workers 8]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import ssl
import sys
import threading
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from loguru import logger

from bench.simagent import SimAgent
from bench.table import print_table
from gpudaemon.backends.simulated import FaultSpec
from gpudaemon.kube.lease import lease_path, renew_period_s
from tests.integration.kube.controlplane import RBAC, ControlPlane
from tests.support import tools_bin

REPO = Path(__file__).resolve().parent.parent


class SimClock:
    def __init__(self) -> None:
        self.t = 1_800_000_000.0

    def __call__(self) -> float:
        return self.t


def watch_writes(
    cp: ControlPlane, path: str, rv: str, counts: Counter[str], stop: threading.Event
) -> None:
    """Count MODIFIED events per object: the writes the API server actually made."""
    ctx = ssl.create_default_context(cafile=str(cp.ca))
    url = f"{cp.server}{path}?watch=1&resourceVersion={rv}&timeoutSeconds=3600"
    req = urllib.request.Request(url, headers={"Authorization": "Bearer admin-token"})
    with urllib.request.urlopen(req, context=ctx, timeout=3600) as resp:
        for line in resp:
            if stop.is_set():
                return
            ev = json.loads(line)
            if ev["type"] == "MODIFIED":
                counts[ev["object"]["metadata"]["name"]] += 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=200)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--lost", type=int, default=2, help="agents that lose a GPU halfway")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--warmup", type=float, default=0.0, help="unmeasured minutes first")
    args = ap.parse_args()
    logger.remove()
    logger.add(sys.stderr, level="ERROR")

    cp = ControlPlane(tools_bin("k8s", "etcd"))
    wall0 = time.monotonic()
    try:
        cp.start()
        cp.apply_manifest(RBAC)
        names = [f"bench-{i:04d}" for i in range(args.nodes)]
        for n in names:
            cp.create_node(n)
        clock = SimClock()
        agents = []
        for i, n in enumerate(names):
            agents.append(SimAgent(n, cp.agent_kubeconfig, seed=i, clock=clock))
        pool = ThreadPoolExecutor(args.workers)

        def each(job: str) -> None:
            list(pool.map(lambda a: a.run_once() if job == "once" else a.run(job), agents))

        # First cycle: every agent writes its Node once (the unavoidable first write).
        each("once")
        # Optional warm-up (not measured): telemetry and reconciles only, so the
        # annotation's smoothing settles before the counting starts.
        for step in range(1, int(args.warmup * 60 / 5) + 1):
            clock.t += 5
            each("telemetry")
            if step * 5 % 30 == 0:
                each("labels")
        modified: Counter[str] = Counter()
        lease_writes: Counter[str] = Counter()
        stop = threading.Event()
        leases = lease_path(agents[0].cfg.kubernetes.lease_namespace)
        for path, counts in (("/api/v1/nodes", modified), (leases, lease_writes)):
            rv = cp.admin.request("GET", path)["metadata"]["resourceVersion"]
            threading.Thread(
                target=watch_writes, args=(cp, path, rv, counts, stop), daemon=True
            ).start()
        period_s = renew_period_s(agents[0].cfg.kubernetes.lease_duration_seconds)
        time.sleep(0.5)
        first_writes = sum(a.writes() for a in agents)
        reads0 = cp.requests("nodes", ("GET",))

        steps = int(args.minutes * 60 / 5)
        renewals = 0
        lost_at = steps // 2
        run0 = time.monotonic()
        for step in range(1, steps + 1):
            clock.t += 5
            sec = step * 5
            if step == lost_at:
                for a in agents[: args.lost]:
                    a.backend.inject(1, FaultSpec(kind="lost"))
            each("telemetry")
            if sec % 30 == 0:
                each("labels")
            if sec % period_s == 0:
                renewals += sum(pool.map(lambda a: a.sink.heartbeat(), agents))
        run_s = time.monotonic() - run0
        node_reads = cp.requests("nodes", ("GET",)) - reads0
        time.sleep(1.0)  # let the watch catch up
        stop.set()

        sink_writes = sum(a.writes() for a in agents) - first_writes
        errors = sum(a.writes("error") for a in agents)
        lost_ok = sum(
            cp.node(n)["metadata"]["labels"]["gpudaemon.io/gpu.healthy"] == "7"
            for n in names[: args.lost]
        )
        node_hours = args.nodes * args.minutes / 60
        steady = [modified[n] for n in names[args.lost :]]
        steady_lease = sum(lease_writes[n] for n in names[args.lost :])
        steady_hours = len(steady) * args.minutes / 60
        rows = [
            ("agents (nodes)", f"{args.nodes}"),
            ("simulated minutes measured (after warm-up)", f"{args.minutes:g} ({args.warmup:g})"),
            (
                "node writes after the first (API server MODIFIED events)",
                f"{sum(modified.values())}",
            ),
            ("node writes after the first (sink success counter)", f"{sink_writes:g}"),
            ("node writes / node-hour (all)", f"{sum(modified.values()) / node_hours:.3f}"),
            (
                "node writes / node-hour (steady nodes only)",
                f"{sum(steady) / (len(steady) * args.minutes / 60):.3f}" if steady else "-",
            ),
            ("max writes on one steady node", f"{max(steady, default=0)}"),
            ("Node reads (kube-apiserver's apiserver_request_total, GET)", f"{node_reads:g}"),
            (
                "Node reads / node-minute (target <= 0.5)",
                f"{node_reads / (args.nodes * args.minutes):.3f}",
            ),
            (f"nodes with a lost GPU reflected ({args.lost} injected)", f"{lost_ok}"),
            ("lease renewal period (s)", f"{period_s}"),
            ("lease writes (API server MODIFIED events)", f"{sum(lease_writes.values())}"),
            ("lease renewals (agent count)", f"{renewals}"),
            ("lease writes / node-hour", f"{sum(lease_writes.values()) / node_hours:.1f}"),
            (
                "Node + Lease writes / steady node-hour (target <= 60)",
                f"{(sum(steady) + steady_lease) / steady_hours:.1f}" if steady else "-",
            ),
            ("write errors", f"{errors:g}"),
            ("wall time of the simulated run (s)", f"{run_s:.1f}"),
            ("machine", f"{platform.node()} {os.cpu_count()} cpu, {platform.python_version()}"),
        ]
        print_table(
            ("metric", "value"), rows, f"bench/apiwrites  {time.strftime('%Y-%m-%d %H:%M')}"
        )
        for a in agents:
            a.close()
        pool.shutdown()
    finally:
        cp.stop()
        print(f"(total wall time {time.monotonic() - wall0:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
