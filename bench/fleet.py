"""bench/fleet: a fleet of simulated agents on a real kube-apiserver, with the real
kube-scheduler and the extender watching it, in real time (issue 19).

For each size (default 1,000 nodes, then 5,000 on the same cluster): plain Ready Node
objects (allocatable 8 nvidia.com/gpu, no kubelet: nothing else writes them), and one
simulated agent per node (bench/simagent.py: the agent's own poller, labeler and
NodeLabelSink with the agent's restricted identity, all sharing one connection pool)
writing labels, the `gpus` annotation and its Lease at the product's cadence: label
reconcile every 30 s (the simulated GPUs are read just before it, as the annotation
only moves then), Lease renewal every 120 s (the 360 s default), kube-retry every
second; agents are spread evenly over those periods, as DaemonSet pods start apart.

After `--warmup` minutes (each node's one settling write of the annotation comes at its
10th reconcile, 5 minutes in), while the fleet runs for `--minutes`, side by side:
  - the agents' API traffic, counted by kube-apiserver itself (apiserver_request_total):
    Node and Lease writes per node-hour, Node reads per node-minute;
  - the extender (`gpudaemon extender`, the default policy unless `--policy`) watching
    Nodes, Leases and pods: its RSS and CPU, and its /filter and /prioritize latency
    (p50/p99) for a real pending pod over every node, asked twice a second by
    bench/probe from a process of its own (in this one the agents' threads would hold
    the client's GIL), which also reads the extender's /metrics every
    `--scrape-every-s` (15 s, the chart's interval), as Prometheus does; beside them the
    extender's own mean time per request, from its request-duration histogram;
  - the rebalancer (`gpudaemon rebalance`, dry run, a pass every 30 s) on the same
    watches: its RSS, CPU and mean pass time (its own pass-duration histogram);
  - then scheduler throughput: `--pods` one-GPU pods through kube-scheduler without the
    extender, and as many through the one calling the extender (deploy/scheduler), timed
    first to last binding from a watch, both schedulers running all along; `--pairs`
    such pairs, the order alternating, each pair's ratio shown and the median taken.

  scripts/bench fleet [--sizes 1000,5000] [--minutes 4] [--warmup 5.5] [--pods 200]
                      [--pairs 3] [--policy NAME] [--scrape-every-s 15]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import orjson
import yaml
from loguru import logger

from bench.extender import SCHED_CONFIG, cpu_s
from bench.simagent import SimAgent
from bench.table import print_table
from gpudaemon.errors import KubeError
from gpudaemon.kube.client import Credentials, KubeClient
from gpudaemon.kube.lease import renew_period_s
from tests.integration.kube.controlplane import RBAC, ControlPlane
from tests.kubeobjects import pod_obj
from tests.support import REPO, free_port, scrape, tools_bin, wait_for

ALLOC = {"nvidia.com/gpu": "8", "cpu": "224", "memory": "2Ti", "pods": "110"}
LABELS_S = 30.0
POD_PATH = "/api/v1/namespaces/default/pods"
WRITE_VERBS = ("PATCH", "APPLY", "UPDATE", "POST", "CREATE")


def bare_node(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
        "status": {
            "capacity": ALLOC,
            "allocatable": ALLOC,
            "conditions": [{"type": "Ready", "status": "True", "reason": "Bench", "message": ""}],
        },
    }


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def pass_times(port: int) -> tuple[float, float]:
    """The rebalancer's (seconds spent in passes, passes) so far, from its /metrics."""
    url, name = f"http://127.0.0.1:{port}/metrics", "gpudaemon_rebalancer_pass_duration_seconds"
    return scrape(url, name + "_sum"), scrape(url, name + "_count")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * q))] if xs else float("nan")


class Fleet:
    """The simulated agents and the one thread that drives their jobs in real time."""

    def __init__(self, cp: ControlPlane, workers: int) -> None:
        self.cp = cp
        self.client = KubeClient.from_credentials(
            Credentials(False, str(cp.agent_kubeconfig)), timeout_s=30
        )
        self.client_lock = threading.Lock()
        self.agents: list[SimAgent] = []
        self.pool = ThreadPoolExecutor(workers)
        self.stop = threading.Event()
        self.errors = 0
        self._thread: threading.Thread | None = None

    def add(self, names: list[str]) -> None:
        start = len(self.agents)
        new = [
            SimAgent(
                n, self.cp.agent_kubeconfig, seed=start + i, clock=time.time, client=self.client
            )
            for i, n in enumerate(names)
        ]
        # Every agent's first cycle: labels, annotation, Lease, fresh-since.
        ok = list(self.pool.map(lambda a: a.run_once(), new))
        self.errors += ok.count(False)
        self.agents += new

    def start(self) -> None:
        self._thread = threading.Thread(target=self._drive, daemon=True)
        self._thread.start()

    def _drive(self) -> None:
        renew_s = float(renew_period_s(self.agents[0].cfg.kubernetes.lease_duration_seconds))
        t0 = time.monotonic()
        tick = 0
        while not self.stop.is_set():
            tick += 1
            n = len(self.agents)
            due: list[tuple[SimAgent, str]] = []
            for i, a in enumerate(self.agents):
                if tick % int(LABELS_S) == i * int(LABELS_S) // n:
                    due.append((a, "labels"))
                if tick % int(renew_s) == i * int(renew_s) // n:
                    due.append((a, "lease"))
            for a in self.agents:
                a.run("kube-retry")  # a no-op unless a write is owed

            def one(job: tuple[SimAgent, str]) -> bool:
                a, what = job
                if what == "labels":
                    return a.run("telemetry") and a.run("labels")
                return a.run("lease")

            self.errors += list(self.pool.map(one, due)).count(False)
            self.stop.wait(max(0.0, t0 + tick - time.monotonic()))

    def close(self) -> None:
        self.stop.set()
        if self._thread is not None:
            self._thread.join(30)
        self.pool.shutdown()
        self.client.close()


class Latency:
    """/filter and /prioritize for a real pending pod over every node, twice a second,
    asked by bench/probe in a process of its own (this one runs the agents, whose
    threads would hold the client's GIL and add their wait to the extender's)."""

    def __init__(
        self, port: int, pod: dict[str, Any], names: list[str], workdir: Path, scrape_s: float
    ) -> None:
        self.port, self.scrape_s = port, scrape_s
        self.body = workdir / "probe-body.json"
        self.body.write_bytes(orjson.dumps({"Pod": pod, "NodeNames": names}))
        self.times: dict[str, list[float]] = {"filter": [], "prioritize": [], "metrics": []}
        self.passed = self.errors = 0
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> subprocess.Popen[bytes]:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.probe", "--port", str(self.port),
             "--body", str(self.body), "--scrape-every-s", str(self.scrape_s)],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )  # fmt: skip
        return self.proc

    def stop(self) -> None:
        """Closing its stdin stops the probe (so does this process's end, however it
        ends); then its figures."""
        if self.proc is None:
            return
        try:
            out, _ = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise SystemExit("bench/probe did not stop within 60 s") from None
        if not out:
            raise SystemExit(f"bench/probe ended with {self.proc.returncode} and no figures")
        got = orjson.loads(out)
        self.times = {v: got[v] for v in self.times}
        self.passed, self.errors = got["passed"], got["errors"]


def in_app_s(port: int) -> dict[str, tuple[float, float]]:
    """Per verb, the extender's own (seconds, requests) so far from its request-duration
    histogram: the time from the request read to the answer, without the wait for it.
    One small filtered read, taken outside the measured window."""
    name = "gpudaemon_extender_request_duration_seconds"
    url = f"http://127.0.0.1:{port}/metrics?name[]={name}_sum&name[]={name}_count"
    return {
        v: (scrape(url, f"{name}_sum", verb=v), scrape(url, f"{name}_count", verb=v))
        for v in ("filter", "prioritize")
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1000,5000")
    ap.add_argument("--minutes", type=float, default=4.0)
    ap.add_argument("--pods", type=int, default=200)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--pairs", type=int, default=3, help="throughput pairs, order alternating")
    ap.add_argument("--policy", default="", help="extender.policy (default: the product's)")
    ap.add_argument(
        "--scrape-every-s",
        type=float,
        default=15.0,
        help="the extender's /metrics read this often during the window, as Prometheus "
        "does (the chart's interval); 0: not at all",
    )
    ap.add_argument(
        "--warmup",
        type=float,
        default=5.5,
        help="minutes before measuring: the annotation's one settling write per node "
        "comes at its 10th reconcile (5 min); steady state is after it",
    )
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    logger.remove()
    logger.add(sys.stderr, level="ERROR")

    cp = ControlPlane(tools_bin("k8s", "etcd"))
    procs: list[subprocess.Popen[bytes]] = []
    fleet: Fleet | None = None
    rows: list[tuple[object, ...]] = []
    try:
        cp.start()
        cp.apply_manifest(RBAC)
        admin = cp.admin
        fleet = Fleet(cp, args.workers)
        pool = ThreadPoolExecutor(args.workers)

        # The extender, and two kube-schedulers (with and without it), all along.
        ext_port = free_port()
        ext_cfg = cp.dir / "extender.yaml"
        ext_cfg.write_text(
            yaml.safe_dump(
                {
                    "kubernetes": {"kubeconfig": str(cp.admin_kubeconfig)},
                    "extender": {"listen": f"127.0.0.1:{ext_port}"}
                    | ({"policy": args.policy} if args.policy else {}),
                    "logging": {"level": "WARNING"},
                }
            )
        )
        ext_log = open(cp.dir / "extender.log", "wb")  # noqa: SIM115 - the child's
        ext = subprocess.Popen(
            [sys.executable, "-m", "gpudaemon", "extender", "--config", str(ext_cfg)],
            cwd=REPO,
            stdout=ext_log,
            stderr=subprocess.STDOUT,
        )
        procs.append(ext)
        # The rebalancer (dry run) on the same watches: its memory and pass time at size.
        rb_port = free_port()
        rb_cfg = cp.dir / "rebalancer.yaml"
        rb_cfg.write_text(
            yaml.safe_dump(
                {
                    "kubernetes": {"kubeconfig": str(cp.admin_kubeconfig)},
                    "extender": {"policy": args.policy} if args.policy else {},
                    "rebalance": {"listen": f"127.0.0.1:{rb_port}", "interval_s": 30},
                    "logging": {"level": "WARNING"},
                }
            )
        )
        rb_log = open(cp.dir / "rebalancer.log", "wb")  # noqa: SIM115 - the child's
        rb = subprocess.Popen(
            [sys.executable, "-m", "gpudaemon", "rebalance", "--config", str(rb_cfg),
             "--identity", "bench"],
            cwd=REPO,
            stdout=rb_log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        procs.append(rb)
        for with_ext in (True, False):
            conf = yaml.safe_load(SCHED_CONFIG.read_text())
            conf["leaderElection"] = {"leaderElect": False}
            conf["clientConnection"] = {
                "kubeconfig": str(cp.admin_kubeconfig),
                "qps": 500,
                "burst": 1000,
            }
            if with_ext:
                conf["extenders"][0]["urlPrefix"] = f"http://127.0.0.1:{ext_port}"
            else:
                conf.pop("extenders")
                conf["profiles"][0]["schedulerName"] = "plain-scheduler"
            path = cp.dir / f"sched-{with_ext}.yaml"
            path.write_text(yaml.safe_dump(conf))
            log = open(cp.dir / f"sched-{with_ext}.log", "wb")  # noqa: SIM115
            procs.append(
                subprocess.Popen(
                    [
                        str(cp.bin / "kube-scheduler"),
                        f"--config={path}",
                        f"--secure-port={free_port()}",
                        "--bind-address=127.0.0.1",
                        f"--authentication-kubeconfig={cp.admin_kubeconfig}",
                        f"--authorization-kubeconfig={cp.admin_kubeconfig}",
                        "--v=1",
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )

        def ext_ready() -> bool:
            c = http.client.HTTPConnection("127.0.0.1", ext_port, timeout=2)
            c.request("GET", "/readyz")
            return c.getresponse().status == 200

        wait_for(ext_ready, timeout=120, interval=0.5, what="extender /readyz")

        # A pod the scheduler can place nowhere (so it never asks the extender), but the
        # extender knows it from its pending-pod watch: the latency probe's pod.
        probe = pod_obj("probe", 1)
        probe["metadata"].pop("uid")
        probe["spec"]["nodeSelector"] = {"bench": "nowhere"}
        probe.pop("status")
        probe = admin.request("POST", "/api/v1/namespaces/default/pods", body=probe)

        created = 0
        for size in sizes:
            names = [f"gpu-{i:05d}" for i in range(created, size)]
            t0 = time.monotonic()
            list(
                pool.map(lambda n: admin.request("POST", "/api/v1/nodes", body=bare_node(n)), names)
            )
            # TaintNodesByCondition tainted them not-ready at creation; no kubelet lifts it.
            list(
                pool.map(
                    lambda n: admin.request(
                        "PATCH",
                        f"/api/v1/nodes/{n}",
                        body={"spec": {"taints": None}},
                        content_type="application/merge-patch+json",
                    ),
                    names,
                )
            )
            if fleet._thread is not None:
                fleet.stop.set()
                fleet._thread.join(30)
                fleet.stop.clear()
            fleet.add(names)
            created = size
            setup_s = time.monotonic() - t0
            print(f"({size} nodes and agents up in {setup_s:.0f} s)", file=sys.stderr)
            fleet.start()
            time.sleep(args.warmup * 60)  # past the start burst and the settling write

            all_names = [f"gpu-{i:05d}" for i in range(size)]
            lat = Latency(ext_port, probe, all_names, cp.dir, args.scrape_every_s)
            counts0 = {
                "node_reads": cp.requests("nodes", ("GET",)),
                "node_writes": cp.requests("nodes", WRITE_VERBS),
                "lease_writes": cp.requests("leases", WRITE_VERBS),
            }
            app0 = in_app_s(ext_port)
            cpu0, w0 = cpu_s(ext.pid), time.monotonic()
            rb_cpu0, rb_pass0 = cpu_s(rb.pid), pass_times(rb_port)
            rss_max = rb_rss_max = 0.0
            procs.append(lat.start())
            end = w0 + args.minutes * 60
            while time.monotonic() < end:
                rss_max = max(rss_max, rss_mib(ext.pid))
                rb_rss_max = max(rb_rss_max, rss_mib(rb.pid))
                time.sleep(5)
            lat.stop()
            window = time.monotonic() - w0
            cpu = (cpu_s(ext.pid) - cpu0) / window * 100
            rb_cpu = (cpu_s(rb.pid) - rb_cpu0) / window * 100
            app1 = in_app_s(ext_port)
            app_ms = {
                v: (app1[v][0] - app0[v][0]) / max(1.0, app1[v][1] - app0[v][1]) * 1e3 for v in app0
            }
            rb_pass = pass_times(rb_port)
            rb_passes = rb_pass[1] - rb_pass0[1]
            rb_pass_ms = (rb_pass[0] - rb_pass0[0]) / rb_passes * 1e3 if rb_passes else 0.0
            counts = {
                "node_reads": cp.requests("nodes", ("GET",)) - counts0["node_reads"],
                "node_writes": cp.requests("nodes", WRITE_VERBS) - counts0["node_writes"],
                "lease_writes": cp.requests("leases", WRITE_VERBS) - counts0["lease_writes"],
            }
            node_h = size * window / 3600

            # Scheduler throughput, both schedulers running all along.
            def throughput(sched: str, run: int, size: int = size) -> float:
                tag = f"{sched}-{size}-{run}"
                pods = [f"{tag}-{i:04d}" for i in range(args.pods)]
                _, rv = admin.list_items("/api/v1/namespaces/default/pods", {"limit": "1"})
                bound: dict[str, float] = {}
                done = threading.Event()

                def seen(obj: dict[str, Any]) -> None:
                    name = (obj.get("metadata") or {}).get("name")
                    if (obj.get("spec") or {}).get("nodeName") and name not in bound:
                        bound[name] = time.monotonic()
                        if len(bound) >= len(pods):
                            done.set()

                def watch() -> None:
                    # Resumed where it ended: a stream the server closes or breaks must not
                    # leave the run waiting for bindings it already made.
                    q, path, since = {"labelSelector": f"bench-run={tag}"}, POD_PATH, rv
                    while not done.is_set():
                        try:
                            for _kind, obj in admin.watch(path, since, 60, q):
                                since = (obj.get("metadata") or {}).get("resourceVersion", since)
                                seen(obj)
                                if done.is_set():
                                    return
                        except KubeError as e:
                            print(
                                f"({tag}: watch ended: {e}; resumed from a list)", file=sys.stderr
                            )
                            try:
                                items, since = admin.list_items(path, q)
                            except KubeError:
                                time.sleep(1)  # and again
                                continue
                            for obj in items:
                                seen(obj)

                threading.Thread(target=watch, daemon=True).start()
                time.sleep(0.5)

                def make(n: str) -> None:
                    body = pod_obj(n, 1, scheduler=sched, labels={"bench-run": tag})
                    body["metadata"].pop("uid")
                    body.pop("status")
                    admin.request("POST", "/api/v1/namespaces/default/pods", body=body)

                list(pool.map(make, pods))
                if not done.wait(900):
                    raise SystemExit(f"{tag}: only {len(bound)} of {len(pods)} pods bound")
                ts = sorted(bound.values())
                return (len(ts) - 1) / (ts[-1] - ts[0]) if ts[-1] > ts[0] else float("inf")

            pairs: list[tuple[float, float]] = []
            for run in range(args.pairs):  # alternating, so neither always goes first
                order = ("plain-scheduler", "gpudaemon-scheduler")
                got = {s: throughput(s, run) for s in (order if run % 2 == 0 else order[::-1])}
                pairs.append((got["plain-scheduler"], got["gpudaemon-scheduler"]))
            ratios = sorted(w / p for p, w in pairs)
            f, p, m = lat.times["filter"], lat.times["prioritize"], lat.times["metrics"]
            rows.append(
                (
                    size,
                    f"{(counts['node_writes'] + counts['lease_writes']) / node_h:.1f}",
                    f"{counts['node_writes'] / node_h:.2f}",
                    f"{counts['node_reads'] / (size * window / 60):.3f}",
                    f"{rss_max:.0f}",
                    f"{cpu:.1f}",
                    f"{pct(f, 0.5) * 1e3:.1f} / {pct(f, 0.99) * 1e3:.1f}",
                    f"{pct(p, 0.5) * 1e3:.1f} / {pct(p, 0.99) * 1e3:.1f}",
                    f"{app_ms['filter']:.1f} / {app_ms['prioritize']:.1f}",
                    f"{pct(m, 0.5) * 1e3:.0f} / {max(m, default=0) * 1e3:.0f} ({len(m)})",
                    f"{lat.passed}",
                    f"{lat.errors}",
                    " ".join(f"{p:.0f}" for p, _ in pairs),
                    " ".join(f"{w:.0f}" for _, w in pairs),
                    " ".join(f"{w / p:.2f}" for p, w in pairs),
                    f"{ratios[len(ratios) // 2]:.2f}",
                    f"{setup_s:.0f}",
                    f"{fleet.errors}",
                    f"{rb_rss_max:.0f}",
                    f"{rb_cpu:.1f}",
                    f"{rb_pass_ms:.0f} ({rb_passes:.0f})",
                )
            )
            print(json.dumps(rows[-1]), file=sys.stderr)
    finally:
        if fleet is not None:
            fleet.close()
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
        cp.stop()
    print_table(
        (
            "nodes",
            "agent writes / node-hour (Node + Lease, <= 60)",
            "of which Node",
            "Node reads / node-minute (<= 0.5)",
            "extender RSS MiB (max)",
            "extender CPU % of a core",
            "/filter p50 / p99 ms",
            "/prioritize p50 / p99 ms",
            "in the extender, mean ms (/filter / /prioritize)",
            "/metrics scrape p50 / max ms (scrapes)",
            "nodes /filter passes (candidates)",
            "probe errors",
            "pods/s without extender (each pair)",
            "pods/s with extender",
            "ratio (each pair)",
            "ratio, median",
            "setup s",
            "agent job errors",
            "rebalancer RSS MiB (max)",
            "rebalancer CPU % of a core",
            "rebalancer pass ms, mean (passes)",
        ),
        rows,
        title=(
            f"bench/fleet  {time.strftime('%Y-%m-%d')}  {platform.node()}  {os.cpu_count()} cpu"
            f"  python {platform.python_version()}  warm-up {args.warmup:g} min, window"
            f" {args.minutes:g} min  "
            f"{args.pods} pods per scheduler, {args.pairs} pairs"
            f"  policy {args.policy or 'default'}"
        ),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
