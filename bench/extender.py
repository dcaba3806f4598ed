"""bench/extender: the scheduler extender's latency, memory and effect on throughput.

1. codec: decode ExtenderArgs and encode the answer for 5,000 nodes, stdlib json vs
   orjson (the codec the extender uses).
2. latency: /filter and /prioritize round trips over a real socket (keep-alive, as
   kube-scheduler's client does) to the extender's own HTTP server, with 100, 1,000 and
   5,000 nodes in its caches, every node named in each request (nodeCacheCapable),
   for each policy; p50/p99. At 1,000 and 5,000 nodes also DRA rows (extender_dra.py):
   the GPUs in ResourceSlices, claims allocated and pending in the caches.
3. cluster (real etcd + kube-apiserver + kube-scheduler, and the real
   `gpudaemon extender` process): scheduler throughput at 500 nodes with and without
   the extender, same scheduler config, same run: pods are created first with the
   scheduler stopped, then the scheduler starts and the time from its first to its
   last binding is measured from a watch, with the CPU time each process spent per pod.
   `--rounds` pairs, the order alternating. Then 4,500 more nodes: the extender
   process's RSS at 5,000.
4. reservations (issue 28): /filter at 5,000 nodes with 20,000 pending pods of the
   scheduler in the pending cache (verified, as the real extender does), with and
   without the rebalancer's Lease holding live reservations, the requests of both
   interleaved in one run; p99 side by side and their ratio (target: within 2x).
5. scrape: the extender's GET /metrics in process at 1,000 and 5,000 nodes, the
   per-node families through prometheus-client (as before) against
   NodeCollector.render (now), text and OpenMetrics, checked to be the same bytes.

  scripts/bench extender [--quick] [--requests 300] [--pods 1000] [--rounds 3]
                 [--candidates N] [--sizes 100,1000,5000] [--policies fragmentation,...]
                 [--events-per-s N]
                 [--no-cluster | --cluster-only | --reservations-only | --dra-only
                  | --latency-only | --scrape-only]

`--events-per-s N` measures each latency row again while N agents' watch events a second
(a Node's `gpus` annotation moved, a Lease renewed, in turn; each decoded from JSON on
its own thread, as the informers do) reach the extender's cache.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import random
import statistics
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
from prometheus_client import CollectorRegistry

from bench.extender_dra import dra_rows
from bench.table import print_table
from gpudaemon.agent.cache import Cache
from gpudaemon.backends.simulated import SimulatedBackend, load_profile
from gpudaemon.cluster.clusterstate import ClusterState
from gpudaemon.cluster.policies import BinPack
from gpudaemon.cluster.policies.fragmentation import Fragmentation
from gpudaemon.cluster.reservations import LeaseReservations, Reservation, encode
from gpudaemon.cluster.state import PodShape
from gpudaemon.config import load_config
from gpudaemon.extender.api import ExtenderApi
from gpudaemon.extender.app import make_policies
from gpudaemon.extender.metrics import NodeCollector
from gpudaemon.extender.pods import PendingPods, PodVerifier
from gpudaemon.httpserver import HttpServer
from gpudaemon.labels import NodeLabeler
from tests.kubeobjects import lease_obj, node_obj, pod_obj

REPO = Path(__file__).resolve().parent.parent

P = "gpudaemon.io/"
SCHED_CONFIG = REPO / "deploy" / "scheduler" / "kube-scheduler-config.yaml"


def agent_metadata(seed: int) -> tuple[dict[str, str], dict[str, str]]:
    """Labels and annotations the agent's own labeler computes for a simulated DGX."""
    backend = SimulatedBackend(load_profile("dgx-h100"), seed=seed)
    cache = Cache()
    cache.put_inventory(backend.inventory())
    snap = cache.put_samples(backend.sample())
    ls = NodeLabeler(P).build(snap)
    return dict(ls.labels), dict(ls.annotations)


UNVERIFIED = "gpudaemon_extender_unverified_pods_total{"  # pods not booked (issue 17)


JSON_CT = {"Content-Type": "application/json"}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


def table(title: str, header: list[str], rows: list[list[str]]) -> None:
    print_table(header, rows, title)


# -- 1. codec ---------------------------------------------------------------------------


def bench_codec(n: int = 5000, reps: int = 200) -> None:
    names = [f"node-{i:05d}" for i in range(n)]
    body = json.dumps({"Pod": pod_obj("p", 2), "NodeNames": names}).encode()
    answer = [{"Host": x, "Score": i % 11} for i, x in enumerate(names)]
    rows = []
    for label, loads, dumps in (
        ("json (stdlib)", json.loads, lambda o: json.dumps(o).encode()),
        ("orjson", orjson.loads, orjson.dumps),
    ):
        t0 = time.perf_counter()
        for _ in range(reps):
            loads(body)
        dec = (time.perf_counter() - t0) / reps * 1000
        t0 = time.perf_counter()
        for _ in range(reps):
            dumps(answer)
        enc = (time.perf_counter() - t0) / reps * 1000
        rows.append([label, f"{dec:.3f}", f"{enc:.3f}", f"{dec + enc:.3f}"])
    table(
        f"codec: ExtenderArgs ({len(body) / 1024:.0f} KiB, {n} names) in,"
        " HostPriorityList out; ms per request",
        ["codec", "decode ms", "encode ms", "total ms"],
        rows,
    )


# -- 2. latency -------------------------------------------------------------------------


def filled_cluster(n: int, rng: random.Random) -> ClusterState:
    c = ClusterState(P)
    meta = [agent_metadata(s) for s in range(8)]
    nodes = []
    pods = []
    for i in range(n):
        name = f"node-{i:05d}"
        labels, ann = meta[i % len(meta)]
        nodes.append(node_obj(name, labels, ann))
        for j in range(rng.randint(0, 4)):
            pods.append(pod_obj(f"{name}-p{j}", rng.choice([1, 1, 2]), node=name))
    c.replace_nodes(nodes)
    c.replace_pods(pods)
    c.replace_leases([lease_obj(f"node-{i:05d}", f"node-{i:05d}") for i in range(n)])
    return c


class WatchTraffic:
    """Agents' watch events delivered to the cache while requests run, as the informers
    deliver them: each decoded from JSON on its own thread, then handed to the cache. Per
    event, in turn: a Node whose `gpus` annotation moved (a label reconcile) or a renewed
    Lease, for nodes taken in order."""

    def __init__(self, cluster: ClusterState, n: int, per_s: float) -> None:
        self.cluster, self.n, self.per_s = cluster, n, per_s
        self.sent = 0
        self._stop = threading.Event()
        meta = [agent_metadata(s) for s in range(8)]
        self._nodes = [
            orjson.dumps(node_obj(f"node-{i:05d}", *meta[(i + 1) % len(meta)]))
            for i in range(min(n, 512))
        ]
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> WatchTraffic:
        if self.per_s > 0:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        k, t0 = 0, time.monotonic()
        while not self._stop.is_set():
            due = t0 + k / self.per_s
            if (wait := due - time.monotonic()) > 0:
                self._stop.wait(wait)
            i = k % self.n
            if k % 2:
                body = orjson.dumps(lease_obj(f"node-{i:05d}", f"node-{i:05d}"))
                self.cluster.lease_event("MODIFIED", orjson.loads(body))
            else:
                obj = orjson.loads(self._nodes[k % len(self._nodes)])
                obj["metadata"]["name"] = obj["metadata"]["uid"] = f"node-{i:05d}"
                self.cluster.node_event("MODIFIED", obj)
            k += 1
            self.sent = k


def bench_latency(
    sizes: list[int],
    requests: int,
    only: tuple[str, ...] = (),
    events_per_s: float = 0,
    dra: bool = True,
) -> None:
    """`only`: these policies alone (--dra-only: the ones the DRA rows measure).
    `events_per_s`: also each row again while the agents' watch events arrive."""
    rng = random.Random(1)
    cfg = load_config(None, environ={})
    policies = make_policies(cfg)
    # A learned workload, as in production: the typical shapes come from arriving pods.
    learners = [p for p in policies.values() if isinstance(p, Fragmentation)]
    for k in range(500):
        shape = PodShape(
            gpus=rng.choice([1, 1, 1, 2, 4, 8]),
            cpu_milli=rng.choice([2000, 4000, 8000, 16000, 32000]),
            memory_bytes=rng.choice([8, 16, 32, 64, 128]) << 30,
        )
        for frag in learners:  # fragmentation and fragmentation-model (the default)
            frag.observe_pod(f"warm-{k}", shape)
    rows = []
    for n in sizes:
        cluster = filled_cluster(n, rng)
        names = [f"node-{i:05d}" for i in range(n)]
        for policy in sorted(p for p in policies if not only or p in only):
            api = ExtenderApi(
                cluster,
                policies,
                policy,
                CollectorRegistry(),
                lambda: (True, "ok"),
                candidates=cfg.extender.candidates,
            )
            server = HttpServer("127.0.0.1:0", api, name="extender", max_body_bytes=64 << 20)
            server.start()
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
            rates = (0.0, events_per_s) if events_per_s > 0 else (0.0,)
            # "prioritize (candidates)": what kube-scheduler sends after /filter, the
            # names it passed (`candidates`, 10 by default); "prioritize": every node
            # named, the worst case (`candidates: 0`).
            verbs = ("filter", "prioritize", "prioritize (candidates)")
            for rate, verb in [(r, v) for r in rates for v in verbs]:
                with WatchTraffic(cluster, n, rate) as traffic:
                    times, started = [], time.monotonic()
                    for k in range(requests + 20):
                        pod = pod_obj(f"bench-{policy}-{verb}-{n}-{k}", rng.choice([1, 2, 4, 8]))
                        pod["metadata"]["uid"] = ""  # do not leave assumptions behind
                        body = orjson.dumps({"Pod": pod, "NodeNames": names})
                        path = "/" + verb.split()[0]
                        if verb != path[1:]:  # the names the filter passed, untimed
                            conn.request("POST", "/filter", body, JSON_CT)
                            passed = orjson.loads(conn.getresponse().read())["NodeNames"]
                            body = orjson.dumps({"Pod": pod, "NodeNames": passed})
                        t0 = time.perf_counter()
                        conn.request("POST", path, body, JSON_CT)
                        resp = conn.getresponse()
                        data = resp.read()
                        dt = time.perf_counter() - t0
                        assert resp.status == 200, data[:200]
                        if k >= 20:  # warm-up
                            times.append(dt * 1000)
                    elapsed = time.monotonic() - started
                rows.append(
                    [
                        f"{n}",
                        policy,
                        verb,
                        f"{traffic.sent / elapsed:.0f}" if rate else "-",
                        f"{pct(times, 50):.2f}",
                        f"{pct(times, 99):.2f}",
                        f"{max(times):.2f}",
                        f"{len(body) / 1024:.0f}",
                    ]
                )
            conn.close()
            server.stop()
        if dra and n >= 1000:  # the DRA rows (issue 32): slices and claims in the caches
            meta = [agent_metadata(s) for s in range(8)]
            dra = dra_rows(n, requests, rng, policies, cfg.extender.candidates, meta, pct)
            rows += [[*r[:3], "-", *r[3:]] for r in dra]
    table(
        f"latency: round trip over a real socket, {requests} requests each"
        " (target p99 <= 10 ms at 5,000; <= 20 ms with the agents' watch events)",
        ["nodes", "policy", "verb", "events/s", "p50 ms", "p99 ms", "max ms", "body KiB"],
        rows,
    )


# -- 5. scrape -------------------------------------------------------------------------


def drop_created(body: bytes) -> bytes:
    return b"\n".join(line for line in body.split(b"\n") if b"_created" not in line)


def bench_scrape(sizes: list[int], rounds: int) -> None:
    """GET /metrics of the extender's app in process, the per-node families written by
    prometheus-client (the collector registered like any other, as before) against
    NodeCollector.render (the extender now), text and OpenMetrics, alternating; the
    median of `rounds` each. Both answers are the same bytes."""
    rows = []
    for n in sizes:
        cluster = filled_cluster(n, random.Random(1))
        before_reg, now_reg = CollectorRegistry(), CollectorRegistry()
        apis = {
            "prometheus-client": ExtenderApi(
                cluster, {"binpack": BinPack()}, "binpack", before_reg, lambda: (True, "ok")
            ),
            "NodeCollector.render": ExtenderApi(
                cluster,
                {"binpack": BinPack()},
                "binpack",
                now_reg,
                lambda: (True, "ok"),
                nodes=NodeCollector(cluster),
            ),
        }
        before_reg.register(NodeCollector(cluster))  # after the API's own: the same order
        for fmt, accept in (("text", ""), ("OpenMetrics", "application/openmetrics-text")):
            times: dict[str, list[float]] = {k: [] for k in apis}
            bodies: dict[str, bytes] = {}
            for _ in range(rounds):
                for name, api in apis.items():
                    env = {"PATH_INFO": "/metrics", "REQUEST_METHOD": "GET", "QUERY_STRING": "",
                           "HTTP_ACCEPT": accept}  # fmt: skip
                    t0 = time.perf_counter()
                    bodies[name] = b"".join(api(env, lambda s, h: None))
                    times[name].append((time.perf_counter() - t0) * 1000)
            # The same bytes but for the `_created` times of two registries' counters.
            same = len({drop_created(b) for b in bodies.values()}) == 1
            med = {k: statistics.median(v) for k, v in times.items()}
            a, b = med["prometheus-client"], med["NodeCollector.render"]
            kib = len(bodies["NodeCollector.render"]) >> 10
            same_text = "yes" if same else "NO"
            rows.append([f"{n}", fmt, f"{a:.1f}", f"{b:.1f}", f"{a / b:.1f}x", f"{kib}", same_text])
    table(
        f"scrape: the extender's GET /metrics in process, median of {rounds}",
        ["nodes", "format", "prometheus-client ms", "render ms", "faster", "KiB", "same bytes"],
        rows,
    )
    print("same bytes: but for the `_created` times of the two registries' own counters")


# -- 3. cluster -------------------------------------------------------------------------


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (and its reaped children) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def bench_cluster(
    pods: int, extra_nodes: int, rounds: int, ext_config: dict[str, Any], unbatched: bool = False
) -> None:
    from tests.integration.kube.controlplane import ControlPlane
    from tests.support import free_port, tools_bin, wait_for

    cp = ControlPlane(tools_bin("k8s", "etcd"))
    procs: list[subprocess.Popen[bytes]] = []
    rows: list[list[str]] = []
    try:
        cp.start()
        admin = cp.admin
        admin.request(
            "POST",
            "/api/v1/namespaces",
            body={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "gpudaemon"}},
        )
        meta = [agent_metadata(s) for s in range(8)]
        pool = ThreadPoolExecutor(8)

        def add_nodes(start: int, count: int) -> None:
            def one(i: int) -> None:
                name = f"node-{i:05d}"
                labels, ann = meta[i % len(meta)]
                created = admin.request("POST", "/api/v1/nodes", body=node_obj(name, labels, ann))
                admin.request(
                    "PATCH",
                    f"/api/v1/nodes/{name}",
                    body={"spec": {"taints": None}},
                    content_type="application/merge-patch+json",
                )
                admin.request(
                    "POST",
                    "/apis/coordination.k8s.io/v1/namespaces/gpudaemon/leases",
                    body=lease_obj(name, created["metadata"]["uid"]),
                )

            list(pool.map(one, range(start, start + count)))

        t0 = time.monotonic()
        add_nodes(0, 500)
        print(f"(500 nodes created in {time.monotonic() - t0:.0f} s)", file=sys.stderr)

        # The real extender process.
        ext_port = free_port()
        ext_cfg = cp.dir / "extender.yaml"
        ext_cfg.write_text(
            yaml.safe_dump(
                {
                    "kubernetes": {"kubeconfig": str(cp.admin_kubeconfig)},
                    "extender": {"listen": f"127.0.0.1:{ext_port}", **ext_config},
                    "logging": {"level": "WARNING"},
                }
            )
        )
        ext = subprocess.Popen(
            [sys.executable, "-m", "gpudaemon", "extender", "--config", str(ext_cfg)], cwd=REPO
        )
        procs.append(ext)
        wait_for(
            lambda: (
                http.client.HTTPConnection("127.0.0.1", ext_port, timeout=2).request(
                    "GET", "/readyz"
                )
                or True
            ),
            timeout=60,
            what="extender up",
        )

        def ready() -> bool:
            c = http.client.HTTPConnection("127.0.0.1", ext_port, timeout=2)
            c.request("GET", "/readyz")
            return c.getresponse().status == 200

        wait_for(ready, timeout=60, interval=0.2, what="extender caches synced")

        def run(label: str, with_extender: bool, rnd: int, gates: str = "") -> float:
            sched = f"bench-{label}-{rnd}"
            conf = yaml.safe_load(SCHED_CONFIG.read_text())
            conf["leaderElection"] = {"leaderElect": False}
            conf["clientConnection"] = {
                "kubeconfig": str(cp.admin_kubeconfig),
                "qps": 500,
                "burst": 1000,
            }
            # Every round's scheduler is `gpudaemon-scheduler`, the name the extender books
            # for (extender.scheduler_name); rounds are told apart by a pod label.
            conf["profiles"][0]["schedulerName"] = "gpudaemon-scheduler"
            if with_extender:
                conf["extenders"][0]["urlPrefix"] = f"http://127.0.0.1:{ext_port}"
            else:
                conf.pop("extenders")
            path = cp.dir / f"{sched}.yaml"
            path.write_text(yaml.safe_dump(conf))
            names = [f"{sched}-{i:04d}" for i in range(pods)]
            list(
                pool.map(
                    lambda n: admin.request(
                        "POST",
                        "/api/v1/namespaces/default/pods",
                        body=pod_obj(n, 1, labels={"bench-run": sched}),
                    ),
                    names,
                )
            )
            # Bindings are timed from one watch (an event per pod), not by listing every
            # pod many times a second: that would take API-server CPU from the run.
            _, rv = admin.list_items(
                "/api/v1/namespaces/default/pods",
                {"labelSelector": f"bench-run={sched}"},
            )
            bound_at: dict[str, float] = {}
            done = threading.Event()

            def watch() -> None:
                query = {"labelSelector": f"bench-run={sched}"}
                path = "/api/v1/namespaces/default/pods"
                while not done.is_set():
                    for _kind, obj in admin.watch(path, rv, 600, query):
                        name = obj["metadata"]["name"]
                        if obj["spec"].get("nodeName") and name not in bound_at:
                            bound_at[name] = time.monotonic()
                            if len(bound_at) >= pods:
                                done.set()
                                return

            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
            time.sleep(0.5)  # the watch is open before the scheduler starts
            log = open(cp.dir / f"{sched}.log", "wb")  # noqa: SIM115
            p = subprocess.Popen(
                [
                    str(cp.bin / "kube-scheduler"),
                    f"--config={path}",
                    f"--secure-port={free_port()}",
                    "--bind-address=127.0.0.1",
                    f"--authentication-kubeconfig={cp.admin_kubeconfig}",
                    f"--authorization-kubeconfig={cp.admin_kubeconfig}",
                    "--v=2",
                    *([f"--feature-gates={gates}"] if gates else []),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            procs.append(p)
            who = {"scheduler": p, "apiserver": cp.apiserver, "etcd": cp.etcd, "extender": ext}
            cpu0 = {k: cpu_s(v.pid) for k, v in who.items() if v is not None}
            if not done.wait(600):
                raise SystemExit(f"{label}: only {len(bound_at)} of {pods} pods bound")
            cpu1 = {k: cpu_s(v.pid) for k, v in who.items() if v is not None}
            p.terminate()
            p.wait(15)
            # From the first binding to the last (scheduler start-up excluded).
            times = sorted(bound_at.values())
            dt = times[-1] - times[0]
            rate = (pods - 1) / dt if dt > 0 else float("inf")
            per_pod = {k: (cpu1[k] - cpu0[k]) / pods * 1000 for k in cpu0}
            rows.append(
                [label, f"{rnd}", f"{pods}", f"{dt:.2f}", f"{rate:.0f}"]
                + [f"{per_pod[k]:.2f}" for k in ("scheduler", "apiserver", "etcd", "extender")]
            )
            # free the GPUs again for the next run
            list(
                pool.map(
                    lambda n: admin.request(
                        "DELETE",
                        f"/api/v1/namespaces/default/pods/{n}",
                        body={"gracePeriodSeconds": 0},
                    ),
                    names,
                )
            )
            time.sleep(2)  # let the deletions settle before the next round
            return rate

        # Background CPU with no scheduler running: a run's CPU per pod includes this
        # share of its duration, so a slower run pays more of it per pod.
        idle = {"apiserver": cp.apiserver, "etcd": cp.etcd, "extender": ext}
        c0 = {k: cpu_s(v.pid) for k, v in idle.items() if v is not None}
        time.sleep(5)
        c1 = {k: cpu_s(v.pid) for k, v in idle.items() if v is not None}
        print(
            "idle CPU, % of one core: "
            + ", ".join(f"{k} {(c1[k] - c0[k]) / 5 * 100:.1f}" for k in c0)
        )
        ratios: list[float] = []
        unbatched_ratios: list[float] = []
        for rnd in range(1, rounds + 1):
            # Alternate the order so neither side always runs on a warmer server.
            order = [False, True] if rnd % 2 else [True, False]
            rate = {w: run("with-extender" if w else "without-extender", w, rnd) for w in order}
            ratios.append(rate[True] / rate[False])
            if unbatched:  # the same scheduler without the extender, and without batching
                nob = run("without-extender-unbatched", False, rnd, "OpportunisticBatching=false")
                unbatched_ratios.append(rate[True] / nob)
        table(
            "throughput: real kube-scheduler, 500 nodes, pods created before the scheduler"
            " starts (bindings timed from a watch)",
            ["scheduler", "round", "pods", "first->last bind s", "pods/s"]
            + [f"{k} CPU ms/pod" for k in ("scheduler", "apiserver", "etcd")]
            # Without the extender in the scheduler, the extender still watches the pods:
            # that row's figure is its watch cost alone.
            + ["extender CPU ms/pod (without: its watches)"],
            rows,
        )
        print(
            "ratio with/without extender, per round: "
            + ", ".join(f"{r:.2f}" for r in ratios)
            + f"; median {statistics.median(ratios):.2f} (target >= 0.5)"
        )
        if unbatched_ratios:
            print(
                "ratio with extender / without it and without OpportunisticBatching, per round: "
                + ", ".join(f"{r:.2f}" for r in unbatched_ratios)
                + f"; median {statistics.median(unbatched_ratios):.2f}"
            )
        # Where the time went: the extender's own request durations (server side).
        c = http.client.HTTPConnection("127.0.0.1", ext_port, timeout=10)
        c.request("GET", "/metrics")
        text = c.getresponse().read().decode()
        stats: dict[str, float] = {}
        for line in text.splitlines():
            for verb in ("filter", "prioritize"):
                for kind in ("sum", "count"):
                    head = f'gpudaemon_extender_request_duration_seconds_{kind}{{verb="{verb}"}}'
                    if line.startswith(head):
                        stats[f"{verb}_{kind}"] = float(line.split()[-1])
        for line in text.splitlines():
            if line.startswith(("gpudaemon_extender_filter_nodes_total{", UNVERIFIED)):
                print("extender", line)
        for verb in ("filter", "prioritize"):
            n = stats.get(f"{verb}_count") or 0
            if n:
                mean_ms = stats[f"{verb}_sum"] / n * 1000
                print(f"extender {verb}: {n:.0f} requests, mean {mean_ms:.2f} ms in the app")

        def rss_mib() -> float:
            for line in Path(f"/proc/{ext.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
            return float("nan")

        rss500 = rss_mib()
        t0 = time.monotonic()
        add_nodes(500, extra_nodes)
        print(
            f"({extra_nodes} more nodes created in {time.monotonic() - t0:.0f} s)", file=sys.stderr
        )
        time.sleep(3)
        # a few requests so the request path is warm too
        names = [f"node-{i:05d}" for i in range(500 + extra_nodes)]
        conn = http.client.HTTPConnection("127.0.0.1", ext_port, timeout=30)
        lat = []
        for k in range(50):
            body = orjson.dumps(
                {
                    "Pod": pod_obj(f"rss-{k}", 2) | {"metadata": {"name": f"rss-{k}", "uid": ""}},
                    "NodeNames": names,
                }
            )
            t = time.perf_counter()
            conn.request("POST", "/prioritize", body)
            r = conn.getresponse()
            r.read()
            lat.append((time.perf_counter() - t) * 1000)
        table(
            "memory: the `gpudaemon extender` process (real watch caches)",
            ["nodes in cache", "RSS MiB", "prioritize p50 ms (real process)"],
            [
                ["500", f"{rss500:.1f}", "-"],
                [f"{500 + extra_nodes}", f"{rss_mib():.1f}", f"{statistics.median(lat):.2f}"],
            ],
        )
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
        cp.stop()


# -- 4. reservations ----------------------------------------------------------------------


def rebalancer_lease(items: list[Reservation]) -> dict[str, Any]:
    """The rebalancer's leader Lease, held, with its reservations (as it writes them)."""
    lease = lease_obj("gpudaemon-rebalancer")
    lease["spec"]["leaseDurationSeconds"] = 3600  # held for the whole run
    lease["metadata"]["annotations"] = {"gpudaemon.io/reservations": encode(items)}
    return lease


def bench_reservations(
    n: int, pending_count: int, counts: list[int], requests: int, candidates: int
) -> None:
    rng = random.Random(4)
    cfg = load_config(None, environ={})
    cluster = filled_cluster(n, rng)
    names = [f"node-{i:05d}" for i in range(n)]
    pending = PendingPods(cluster.product_label)
    pods = []
    for k in range(pending_count):
        p = pod_obj(f"pending-{k:05d}", rng.choice([1, 1, 2, 4, 8]))
        p["spec"]["priority"] = 10 if k < max(counts) else 0  # the reserved pods outrank
        p["status"] = {"phase": "Pending"}
        pods.append(p)
    pending.replace(pods)
    assert len(pending) == pending_count

    def no_lookup(ns: str, name: str) -> dict[str, Any]:
        raise AssertionError("every benched pod is in the pending cache")

    verifier = PodVerifier(pending, no_lookup, "gpudaemon-scheduler")
    reservations = LeaseReservations()
    api = ExtenderApi(
        cluster,
        make_policies(cfg),
        "binpack",
        CollectorRegistry(),
        lambda: (True, "ok"),
        candidates=candidates,
        verifier=verifier,
        reservations=reservations,
    )
    server = HttpServer("127.0.0.1:0", api, name="extender", max_body_bytes=64 << 20)
    server.start()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    # Each reservation on its own node, spread over the fleet: the most nodes to judge.
    step = max(1, n // max(counts))
    rows = []
    try:
        for count in counts:
            live = [
                Reservation(f"pending-{k:05d}", f"default/pending-{k:05d}", names[(k * step) % n],
                            8, 10, time.time() + 600)
                for k in range(count)
            ]  # fmt: skip
            with_lease = rebalancer_lease(live)
            times: dict[bool, list[float]] = {False: [], True: []}
            kept = 0
            for k in range(2 * (requests + 20)):
                on = k % 2 == 1  # interleaved: both see the same machine, same moment
                if on:
                    reservations.event("MODIFIED", with_lease)
                else:
                    reservations.event("DELETED", with_lease)
                # A verified pending pod of priority 0 (the reserved ones are 10).
                uid = f"pending-{max(counts) + rng.randrange(pending_count - max(counts)):05d}"
                pod = pod_obj(uid, 1)
                pod["status"] = {"phase": "Pending"}
                body = orjson.dumps({"Pod": pod, "NodeNames": names})
                t0 = time.perf_counter()
                conn.request("POST", "/filter", body, {"Content-Type": "application/json"})
                resp = conn.getresponse()
                data = resp.read()
                dt = time.perf_counter() - t0
                assert resp.status == 200, data[:200]
                if k >= 40:
                    times[on].append(dt * 1000)
                if on:
                    kept += data.count(b"kept for pending pod")
            p99_off, p99_on = pct(times[False], 99), pct(times[True], 99)
            rows.append(
                [
                    f"{n}",
                    f"{pending_count}",
                    f"{count}",
                    f"{pct(times[False], 50):.2f}",
                    f"{pct(times[True], 50):.2f}",
                    f"{p99_off:.2f}",
                    f"{p99_on:.2f}",
                    f"{p99_on / p99_off:.2f}x",
                    f"{kept / max(1, len(times[True]) + 20):.0f}",
                ]
            )
    finally:
        conn.close()
        server.stop()
    table(
        f"reservations: /filter round trip, {requests} requests each way, interleaved"
        f" (binpack, candidates {candidates}; target: p99 within 2x)",
        ["nodes", "pending pods", "reservations", "p50 off ms", "p50 on ms", "p99 off ms",
         "p99 on ms", "p99 ratio", "nodes refused/req"],
        rows,
    )  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="100 requests, no 5,000-node cluster")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--pods", type=int, default=1000, help="pods per throughput run")
    ap.add_argument("--rounds", type=int, default=3, help="with/without pairs")
    ap.add_argument(
        "--candidates", type=int, default=None, help="extender.candidates (default: config's)"
    )
    ap.add_argument("--no-cluster", action="store_true")
    ap.add_argument("--cluster-only", action="store_true", help="only part 3")
    ap.add_argument(
        "--unbatched",
        action="store_true",
        help="part 3 also runs the scheduler without the extender and without batching",
    )
    ap.add_argument("--reservations-only", action="store_true", help="only part 4")
    dra_help = "only the DRA rows and the device-plugin rows of their policies"
    ap.add_argument("--dra-only", action="store_true", help=dra_help)
    ap.add_argument("--latency-only", action="store_true", help="only part 2, no DRA rows")
    ap.add_argument("--scrape-only", action="store_true", help="only part 5 (--sizes)")
    ap.add_argument("--sizes", default="100,1000,5000", help="nodes per latency row")
    ap.add_argument("--policies", default="", help="latency rows of these policies only")
    ap.add_argument("--events-per-s", type=float, default=0.0, help="watch events a second")
    args = ap.parse_args()
    logger.remove()
    logger.add(sys.stderr, level="ERROR")
    print(
        f"bench/extender  {time.strftime('%Y-%m-%d %H:%M')}  {platform.node()}"
        f" {os.cpu_count()} cpu, Python {platform.python_version()}"
    )
    cand = load_config(None, environ={}).extender.candidates
    if args.candidates is not None:
        cand = args.candidates
    reqs = 100 if args.quick else args.requests
    if args.dra_only:
        bench_latency([1000, 5000], reqs, only=("binpack", "fragmentation"))
        return 0
    if args.latency_only:
        only = tuple(p for p in args.policies.split(",") if p)
        sizes = [int(x) for x in args.sizes.split(",")]
        bench_latency(sizes, reqs, only, args.events_per_s, dra=False)
        return 0
    if args.reservations_only:
        bench_reservations(5000, 20_000, [16, 256], reqs, cand)
        return 0
    if args.scrape_only:
        bench_scrape([int(x) for x in args.sizes.split(",")], 3 if args.quick else 7)
        return 0
    if not args.cluster_only:
        bench_codec()
        bench_latency([100, 1000, 5000], reqs)
        bench_reservations(5000, 20_000, [16, 256], reqs, cand)
        bench_scrape([1000, 5000], 3 if args.quick else 7)
    if not args.no_cluster:
        ext_config = {} if args.candidates is None else {"candidates": args.candidates}
        bench_cluster(args.pods, 0 if args.quick else 4500, args.rounds, ext_config, args.unbatched)
    return 0


if __name__ == "__main__":
    threading.excepthook = lambda a: None  # informer threads of the in-process parts
    sys.exit(main())
