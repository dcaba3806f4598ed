"""bench/openb: GPU packing quality on the openb trace, through the real kube-scheduler.

FGD's protocol (Weng et al., ATC'23) in the whole-GPU view. Cluster: the 1,213 nodes of
openb_node_list_gpu_node.csv as Node objects carrying the labels and `gpus` annotation
the agent's own labeler computes for a simulated profile of each node's GPU model and
count, allocatable cpu/memory/nvidia.com/gpu, Ready, no not-ready taint, and a fresh
Lease. Pods: the pod list shuffled with a seed, taken in order (reshuffled and taken
again when used up) until the arrived GPU requests reach 130% of the cluster's GPUs;
`gpu_milli < 1000` asks for one whole GPU; `gpu_spec` becomes required node affinity
on the product label. A pod the scheduler reports unschedulable is skipped. Nothing that
was placed is ever deleted.

Pipelining (--window N, default 32): up to N pods are created ahead of the scheduler's
decisions. kube-scheduler pops pods one at a time in queue order (equal priority: the
order their creation reached its informer, which is the API server's commit order) and
assumes each decision in its cache before it takes the next pod, so every pod is placed
against the state left by all pods before it -- the sequential protocol -- whatever N
is. Arrival order is therefore taken as commit order (resourceVersion), and the
unallocated GPUs at 100% arrived are computed from each pod's outcome in that order. Two
things could break that equivalence, and both are handled: an unschedulable pod stays
in the scheduler's queue and could be retried and placed out of order later (so it is
deleted the moment PodScheduled=False/Unschedulable is seen -- it never held anything;
any late bind is counted and reported), and an extender reads pods from its own watch,
which may lag the scheduler's cache by a few pods under pipelining (its documented
assume-then-confirm scheme covers this; --window 1 removes the question, at the cost of
speed; the table says which window was used).

Configurations (all percentageOfNodesToScore: 100, one kube-scheduler process each):
  default        the default profile
  mostallocated  NodeResourcesFit MostAllocated over cpu, memory and nvidia.com/gpu
  binpack        deploy/scheduler/kube-scheduler-config.yaml + `gpudaemon extender`
  fragmentation  the same with extender.policy: fragmentation
  *-hami         (on request) binpack/fragmentation with extender.candidates: 1 and
                 NodeResourcesFit MostAllocated scoring the pods asking for no GPU
  fragmentation-all  (on request) extender.gpuless_pods: policy: the policy also ranks
                 the pods asking for no GPU (the shipped profile sends it every pod)
  *-random       (on request) extender.gpuless_pods: random: a pod asking for no GPU
                 scores 0 everywhere (the default before full_nodes_first)
  fragmentation-gpuonly  (on request) managedResources: nvidia.com/gpu, the profile as
                 shipped before issue 40: only GPU pods reach the extender
  fragmentation-model  extender.policy: fragmentation-model, the shipped default (per
                 GPU model, keeping flexible pods off the models pinned pods need)

`--pin 0.33` pins a third of each list's GPU pods to GPU-model sets (PIN_SETS, a
synthetic mix), as FGD made its gpuspec lists from the default one: our lists pin none.

  scripts/bench openb [--fast] [--lists default,multigpu50] [--seeds 1,2,3]
              [--configs default,mostallocated,binpack,fragmentation,fragmentation-model]
              [--window 32]
              [--json FILE] [--keep] [--pin FRACTION]
  scripts/bench openb --table FILE.json ...   (the table of saved runs, merged)

Rows whose list and seeds have a figure in bench/optimum.json (scripts/bench optimum
--write: the offline optimum at the 100% cut) gain that optimum and the gap to it.
"""

from __future__ import annotations

import argparse
import csv
import http.client
import json
import os
import platform
import queue
import random
import shutil
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from bench.table import table
from gpudaemon.agent.cache import Cache
from gpudaemon.backends.simulated import Profile, SimulatedBackend
from gpudaemon.config import load_config
from gpudaemon.labels import NodeLabeler
from tests.integration.kube.controlplane import ControlPlane
from tests.support import free_port, tools_bin, wait_for

REPO = Path(__file__).resolve().parent.parent

TRACES = REPO.parent / "shared" / "traces" / "openb"
NODE_LIST = "openb_node_list_gpu_node.csv"
LISTS = {
    "default": "openb_pod_list_default.csv",
    "multigpu50": "openb_pod_list_multigpu50.csv",
}
GPU = "nvidia.com/gpu"
CONFIGS = ("default", "mostallocated", "binpack", "fragmentation", "fragmentation-model")
# Variants, run on request. -hami: in-tree MostAllocated scores the pods asking for no
# GPU (the extender leaves them neutral), and the extender's filter returns only its
# best node (HAMi style). -all: the policy also ranks pods with no GPU
# (gpuless_pods: policy); -random: they score 0 everywhere. -gpuonly:
# managedResources, so pods with no GPU never reach the extender (on kube-scheduler
# 1.35+ they then take the first feasible node: issue 40).
VARIANTS = (
    "binpack-hami",
    "fragmentation-hami",
    "fragmentation-all",
    "fragmentation-gpuonly",
    "fragmentation-random",
    "fragmentation-model-random",
)
MOST_ALLOCATED = {
    "name": "NodeResourcesFit",
    "args": {
        "scoringStrategy": {
            "type": "MostAllocated",
            "resources": [
                {"name": "cpu", "weight": 1},
                {"name": "memory", "weight": 1},
                {"name": GPU, "weight": 1},
            ],
        }
    },
}
SCHED_CONFIG = REPO / "deploy" / "scheduler" / "kube-scheduler-config.yaml"
OPTIMUM_JSON = REPO / "bench" / "optimum.json"  # written by `scripts/bench optimum --write`
NS = "openb"
ARRIVE_TARGET = 1.3
LEASE_SECONDS = 86400  # the bench measures packing, not freshness: no renewals mid-run

# openb model -> simulated GPU (name as NVML reports it, MiB, compute capability). G1-G3
# are undisclosed in the trace; they are named plainly, with nominal figures.
MODELS: dict[str, tuple[str, int, str]] = {
    "P100": ("Tesla P100-PCIE-16GB", 16280, "6.0"),
    "T4": ("Tesla T4", 15360, "7.5"),
    "V100M16": ("Tesla V100-SXM2-16GB", 16160, "7.0"),
    "V100M32": ("Tesla V100-SXM2-32GB", 32510, "7.0"),
    "A10": ("NVIDIA A10", 23028, "8.6"),
    "G1": ("G1", 32768, "8.0"),
    "G2": ("G2", 32768, "8.0"),
    "G3": ("G3", 32768, "8.0"),
}


# -- the trace ----------------------------------------------------------------------


@dataclass(frozen=True)
class NodeRow:
    name: str
    cpu_milli: int
    memory_mib: int
    gpus: int
    model: str


@dataclass(frozen=True)
class PodRow:
    cpu_milli: int
    memory_mib: int
    gpus: int  # whole-GPU view
    gpu_spec: tuple[str, ...]


def read_nodes(path: Path) -> list[NodeRow]:
    out = []
    with path.open(newline="") as f:
        for i, r in enumerate(csv.DictReader(f)):
            try:
                row = NodeRow(
                    r["sn"], int(r["cpu_milli"]), int(r["memory_mib"]), int(r["gpu"]), r["model"]
                )
            except (KeyError, ValueError, TypeError) as e:
                raise SystemExit(f"{path}: row {i + 2}: bad or missing column ({e})") from None
            out.append(row)
    return out


def read_pods(path: Path) -> list[PodRow]:
    out = []
    with path.open(newline="") as f:
        for i, r in enumerate(csv.DictReader(f)):
            try:
                num, milli = int(r["num_gpu"]), int(r["gpu_milli"])
                gpus = 1 if num >= 1 and milli < 1000 else num
                spec = tuple(m for m in (r.get("gpu_spec") or "").split("|") if m)
                out.append(PodRow(int(r["cpu_milli"]), int(r["memory_mib"]), gpus, spec))
            except (KeyError, ValueError, TypeError) as e:
                raise SystemExit(f"{path}: row {i + 2}: bad or missing column ({e})") from None
    return out


# A synthetic mix of the GPU-model sets pinned pods accept, over the trace's models, for
# lists that pin none (`--pin`): weights, not a sample of any held-out list.
PIN_SETS: tuple[tuple[tuple[str, ...], int], ...] = (
    (("T4",), 30), (("A10", "T4"), 10), (("V100M16", "V100M32"), 15), (("V100M32",), 5),
    (("P100",), 12), (("G3",), 8), (("G2",), 15), (("G2", "G3"), 5),
)  # fmt: skip


def pin_models(
    pods: list[PodRow], nodes: list[NodeRow], fraction: float, seed: int = 7
) -> list[PodRow]:
    """Each GPU pod, with probability `fraction`, made to accept only one model set of
    PIN_SETS (among the sets with a node the pod fits on), drawn by weight: how FGD's
    gpuspec lists were made from the default list, with our own mix of sets."""
    rng = random.Random(seed)
    shapes = {(n.model, n.gpus, n.cpu_milli, n.memory_mib) for n in nodes}
    out = []
    for p in pods:
        if p.gpus > 0 and not p.gpu_spec and rng.random() < fraction:
            fits = [(models, w) for models, w in PIN_SETS
                    if any(m in models and g >= p.gpus and c >= p.cpu_milli and mem >= p.memory_mib
                           for m, g, c, mem in shapes)]  # fmt: skip
            if fits:
                models = rng.choices([m for m, _ in fits], [w for _, w in fits])[0]
                p = PodRow(p.cpu_milli, p.memory_mib, p.gpus, models)
        out.append(p)
    return out


def pod_lists(names: str, ap: argparse.ArgumentParser) -> dict[str, Path]:
    """`--lists`: our lists by name, or CSV paths (named by their stem); a missing one
    is the parser's error line."""
    lists: dict[str, Path] = {}
    for item in names.split(","):
        path = TRACES / LISTS[item] if item in LISTS else Path(item)
        if not path.is_file():
            ap.error(f"no pod list {item!r}")
        lists[item if item in LISTS else path.stem] = path
    return lists


def arrivals(pods: list[PodRow], seed: int, total_gpus: int) -> list[PodRow]:
    """FGD's sequence: shuffled, resampled when used up, until 130% of GPUs arrived."""
    rng = random.Random(seed)
    out: list[PodRow] = []
    arrived = 0
    order: list[PodRow] = []
    while arrived < ARRIVE_TARGET * total_gpus:
        if not order:
            order = list(pods)
            rng.shuffle(order)
        p = order.pop()
        out.append(p)
        arrived += p.gpus
    return out


# -- a small raw API client (one keep-alive connection per thread) ------------------


class Api:
    def __init__(self, cp: ControlPlane) -> None:
        self.host, self.port = "127.0.0.1", cp.port
        self.ctx = ssl.create_default_context(cafile=str(cp.ca))
        self.local = threading.local()

    def conn(self) -> http.client.HTTPSConnection:
        c = getattr(self.local, "c", None)
        if c is None:
            c = self.local.c = http.client.HTTPSConnection(
                self.host, self.port, context=self.ctx, timeout=120
            )
        return c

    def call(
        self, method: str, path: str, body: Any = None, ctype: str = "application/json"
    ) -> tuple[int, dict[str, Any]]:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Authorization": "Bearer admin-token", "Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = ctype
        for attempt in range(3):
            c = self.conn()
            try:
                c.request(method, path, body=data, headers=headers)
                r = c.getresponse()
                raw = r.read()
                return r.status, json.loads(raw) if raw else {}
            except (OSError, http.client.HTTPException):
                c.close()
                self.local.c = None
                if attempt == 2:
                    raise
                time.sleep(0.5)
        raise AssertionError("unreachable")

    def ok(self, method: str, path: str, body: Any = None, ctype: str = "application/json") -> Any:
        status, obj = self.call(method, path, body, ctype)
        if status >= 300:
            raise RuntimeError(f"{method} {path}: {status} {obj.get('message', obj)}")
        return obj

    def watch(self, path: str, rv: str) -> Iterator[dict[str, Any]]:
        c = http.client.HTTPSConnection(self.host, self.port, context=self.ctx, timeout=3600)
        sep = "&" if "?" in path else "?"
        c.request(
            "GET",
            f"{path}{sep}watch=1&resourceVersion={rv}&timeoutSeconds=3600",
            headers={"Authorization": "Bearer admin-token"},
        )
        r = c.getresponse()
        if r.status != 200:
            raise RuntimeError(f"watch {path}: {r.status}")
        try:
            while True:
                line = r.readline()
                if not line:
                    return
                yield json.loads(line)
        finally:
            c.close()


# -- the cluster --------------------------------------------------------------------


def node_labels(row: NodeRow, seed: int, prefix: str) -> tuple[dict[str, str], dict[str, str]]:
    """What the agent's labeler writes for a simulated profile of this model and count."""
    name, mib, cc = MODELS.get(row.model, (row.model, 32768, "8.0"))
    profile = Profile.model_validate(
        {"gpus": [{"name": name, "memory_total_mib": mib, "compute_capability": cc,
                   "count": row.gpus}], "source": f"openb-{row.model}"}
    )  # fmt: skip
    backend = SimulatedBackend(profile, seed=seed)
    try:
        cache = Cache()
        cache.put_inventory(backend.inventory())
        snap = cache.put_samples(backend.sample())
    finally:
        backend.close()
    ls = NodeLabeler(prefix).build(snap)
    return dict(ls.labels), dict(ls.annotations)


def product_values(prefix: str) -> dict[str, str]:
    """openb model -> the product label value the labeler writes for it."""
    out = {}
    for model in MODELS:
        labels, _ = node_labels(NodeRow("x", 1000, 1024, 1, model), 0, prefix)
        out[model] = labels[f"{prefix}gpu.product"]
    return out


def build_cluster(api: Api, nodes: list[NodeRow], prefix: str, lease_ns: str) -> None:
    for ns in (NS, lease_ns):
        status, obj = api.call(
            "POST", "/api/v1/namespaces", {"metadata": {"name": ns}, "apiVersion": "v1"}
        )
        if status >= 300 and status != 409:
            raise RuntimeError(f"namespace {ns}: {status} {obj}")
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")

    def one(i_row: tuple[int, NodeRow]) -> None:
        i, row = i_row
        labels, ann = node_labels(row, i, prefix)
        labels["kubernetes.io/hostname"] = row.name
        alloc = {
            "cpu": f"{row.cpu_milli}m",
            "memory": f"{row.memory_mib}Mi",
            GPU: str(row.gpus),
            "pods": "500",
        }
        api.ok(
            "POST",
            "/api/v1/nodes",
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": row.name, "labels": labels, "annotations": ann},
                "status": {
                    "capacity": alloc,
                    "allocatable": alloc,
                    "conditions": [
                        {"type": "Ready", "status": "True", "reason": "KubeletReady",
                         "message": "bench/openb", "lastHeartbeatTime": now[:19] + "Z",
                         "lastTransitionTime": now[:19] + "Z"}
                    ],
                },
            },
        )  # fmt: skip
        # TaintNodesByCondition tainted it not-ready at creation; no controller lifts it.
        api.ok(
            "PATCH",
            f"/api/v1/nodes/{row.name}",
            {"spec": {"taints": None}},
            "application/merge-patch+json",
        )
        api.ok(
            "POST",
            f"/apis/coordination.k8s.io/v1/namespaces/{lease_ns}/leases",
            {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": row.name, "namespace": lease_ns},
                "spec": {
                    "holderIdentity": row.name,
                    "leaseDurationSeconds": LEASE_SECONDS,
                    "renewTime": now,
                },
            },
        )

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, enumerate(nodes)))


def renew_leases(api: Api, nodes: list[NodeRow], lease_ns: str) -> None:
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")

    def one(row: NodeRow) -> None:
        api.ok(
            "PATCH",
            f"/apis/coordination.k8s.io/v1/namespaces/{lease_ns}/leases/{row.name}",
            {"spec": {"renewTime": now}},
            "application/merge-patch+json",
        )

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, nodes))


def clear_pods(api: Api) -> None:
    api.ok("DELETE", f"/api/v1/namespaces/{NS}/pods?gracePeriodSeconds=0")

    def empty() -> bool:
        return not api.ok("GET", f"/api/v1/namespaces/{NS}/pods?limit=1")["items"]

    wait_for(empty, timeout=300, interval=1, what="pods deleted")


# -- schedulers and the extender ----------------------------------------------------


class Processes:
    def __init__(self, cp: ControlPlane, workdir: Path) -> None:
        self.cp = cp
        self.dir = workdir
        self.procs: list[subprocess.Popen[bytes]] = []

    def extender(self, config: str, label: str) -> str:
        port = free_port()
        policy, *variants = config.split("-")
        ext: dict[str, object] = {"listen": f"127.0.0.1:{port}", "policy": policy}
        if "hami" in variants:
            ext["candidates"] = 1  # the pick alone
        if "all" in variants:
            ext["gpuless_pods"] = "policy"
        if "random" in variants:
            ext["gpuless_pods"] = "random"
        if "model" in variants:
            ext["policy"] = "fragmentation-model"  # the model-aware policy, its own plug-in
        cfg = {
            "extender": ext,
            "kubernetes": {"kubeconfig": str(self.cp.admin_kubeconfig)},
            "logging": {"level": "WARNING"},
        }
        path = self.dir / f"extender-{label}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        log = open(self.dir / f"extender-{label}.log", "wb")  # noqa: SIM115 - the child's
        p = subprocess.Popen(
            [str(REPO / ".venv" / "bin" / "gpudaemon"), "extender", "--config", str(path)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        self.procs.append(p)
        url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            if p.poll() is not None:
                raise SystemExit(
                    f"extender exited {p.returncode}: "
                    + (self.dir / f"extender-{label}.log").read_text()[-2000:]
                )
            import urllib.request

            with urllib.request.urlopen(url + "/readyz", timeout=5) as r:
                return bool(r.status == 200)

        wait_for(ready, timeout=180, interval=0.5, what="extender /readyz")
        return url

    def scheduler(self, config: str, label: str, extender_url: str | None) -> str:
        """Start kube-scheduler for a configuration; returns the schedulerName to use."""
        if extender_url is not None:
            conf = yaml.safe_load(SCHED_CONFIG.read_text())
            conf["extenders"][0]["urlPrefix"] = extender_url
            profile: dict[str, Any] = conf["profiles"][0]
            name = profile["schedulerName"]
            if config.endswith("-hami"):
                score = profile.setdefault("plugins", {}).setdefault("score", {})
                score["disabled"] = [
                    d for d in score.get("disabled", []) if d["name"] != "NodeResourcesFit"
                ]
                profile["pluginConfig"] = [MOST_ALLOCATED]
            if config.endswith("-gpuonly"):
                conf["extenders"][0]["managedResources"] = [
                    {"name": GPU, "ignoredByScheduler": False}
                ]
        else:
            name = "default-scheduler"
            profile = {"schedulerName": name}
            if config == "mostallocated":
                profile["pluginConfig"] = [MOST_ALLOCATED]
            conf = {
                "apiVersion": "kubescheduler.config.k8s.io/v1",
                "kind": "KubeSchedulerConfiguration",
                "percentageOfNodesToScore": 100,
                "profiles": [profile],
            }
        assert conf["percentageOfNodesToScore"] == 100
        conf["leaderElection"] = {"leaderElect": False}
        conf["clientConnection"] = {
            "kubeconfig": str(self.cp.admin_kubeconfig),
            "qps": 5000,
            "burst": 5000,
        }
        path = self.dir / f"scheduler-{label}.yaml"
        path.write_text(yaml.safe_dump(conf))
        port = free_port()
        log = open(self.dir / f"scheduler-{label}.log", "wb")  # noqa: SIM115 - the child's
        p = subprocess.Popen(
            [
                str(self.cp.bin / "kube-scheduler"),
                f"--config={path}",
                f"--secure-port={port}",
                "--bind-address=127.0.0.1",
                f"--authentication-kubeconfig={self.cp.admin_kubeconfig}",
                f"--authorization-kubeconfig={self.cp.admin_kubeconfig}",
                "--v=1",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        self.procs.append(p)

        def healthy() -> bool:
            if p.poll() is not None:
                raise SystemExit(
                    f"kube-scheduler exited {p.returncode}: "
                    + (self.dir / f"scheduler-{label}.log").read_text()[-2000:]
                )
            import urllib.request

            ctx = ssl._create_unverified_context()
            with urllib.request.urlopen(f"https://127.0.0.1:{port}/healthz", context=ctx) as r:
                return bool(r.status == 200)

        wait_for(healthy, timeout=120, interval=0.3, what="kube-scheduler /healthz")
        return str(name)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs = []


# -- one run ------------------------------------------------------------------------


@dataclass
class Outcome:
    gpus: int
    rv: int = 0  # commit order
    node: str | None = None
    skipped: bool = False
    late: bool = False  # bound after it was reported unschedulable


@dataclass
class RunResult:
    config: str
    pod_list: str
    seed: int
    pods: int
    unalloc_100: float
    unalloc_130: float
    skipped_100: int
    skipped: int
    wall_s: float
    late_binds: int
    window: int
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def pods_per_s(self) -> float:
        return self.pods / self.wall_s if self.wall_s else 0.0


def pod_body(i: int, p: PodRow, scheduler: str, products: dict[str, str], prefix: str) -> Any:
    requests = {"cpu": f"{p.cpu_milli}m", "memory": f"{p.memory_mib}Mi"}
    limits: dict[str, str] = {}
    if p.gpus:
        requests[GPU] = limits[GPU] = str(p.gpus)
    spec: dict[str, Any] = {
        "schedulerName": scheduler,
        "terminationGracePeriodSeconds": 0,
        "containers": [
            {
                "name": "c",
                "image": "registry.k8s.io/pause:3.10",
                "resources": {"requests": requests, "limits": limits},
            }
        ],
    }
    if p.gpu_spec:
        values = sorted({products.get(m, m) for m in p.gpu_spec})
        spec["affinity"] = {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchExpressions": [
                                {"key": f"{prefix}gpu.product", "operator": "In", "values": values}
                            ]
                        }
                    ]
                }
            }
        }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"p{i:06d}", "namespace": NS},
        "spec": spec,
    }


def unschedulable(pod: dict[str, Any]) -> bool:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False":
            return bool(c.get("reason") == "Unschedulable")
    return False


def run_once(
    api: Api,
    seq: list[PodRow],
    scheduler: str,
    products: dict[str, str],
    prefix: str,
    total_gpus: int,
    window: int,
    progress: str,
) -> tuple[dict[str, Outcome], float]:
    outcomes: dict[str, Outcome] = {}
    decided: set[str] = set()
    cond = threading.Condition()
    stop = threading.Event()
    to_delete: queue.Queue[str | None] = queue.Queue()
    rv0 = api.ok("GET", f"/api/v1/namespaces/{NS}/pods?limit=1")["metadata"]["resourceVersion"]

    def watcher() -> None:
        for ev in api.watch(f"/api/v1/namespaces/{NS}/pods", rv0):
            if stop.is_set():
                return
            if ev.get("type") not in ("ADDED", "MODIFIED"):
                continue
            pod = ev["object"]
            name = pod["metadata"]["name"]
            node = (pod.get("spec") or {}).get("nodeName")
            with cond:
                o = outcomes.get(name)
                if o is None:  # the create's answer is not in yet
                    o = outcomes[name] = Outcome(gpus=-1)
                if node and o.node is None:
                    o.node = node
                    if o.skipped:
                        o.late = True
                    decided.add(name)
                    cond.notify_all()
                elif not node and not o.skipped and unschedulable(pod):
                    o.skipped = True
                    decided.add(name)
                    to_delete.put(name)
                    cond.notify_all()

    def deleter() -> None:
        while (name := to_delete.get()) is not None:
            # Skipped: it must not come back out of order. It never held anything.
            api.call("DELETE", f"/api/v1/namespaces/{NS}/pods/{name}?gracePeriodSeconds=0")

    threads = [
        threading.Thread(target=watcher, daemon=True),
        threading.Thread(target=deleter, daemon=True),
    ]
    for t in threads:
        t.start()
    t0 = time.monotonic()
    last_print = t0
    for i, p in enumerate(seq):
        name = f"p{i:06d}"
        with cond:
            while i - len(decided) >= window:
                if not cond.wait(600):
                    raise RuntimeError(f"{progress}: no scheduling decision for 600 s")
        created = api.ok(
            "POST", f"/api/v1/namespaces/{NS}/pods", pod_body(i, p, scheduler, products, prefix)
        )
        with cond:
            o = outcomes.setdefault(name, Outcome(gpus=p.gpus))
            o.gpus = p.gpus
            o.rv = int(created["metadata"]["resourceVersion"])
        now = time.monotonic()
        if now - last_print > 15:
            last_print = now
            print(f"  {progress}: {i}/{len(seq)} pods, {i / (now - t0):.0f}/s", file=sys.stderr)
    with cond:
        while len(decided) < len(seq):
            if not cond.wait(600):
                raise RuntimeError(f"{progress}: {len(seq) - len(decided)} pods undecided")
    wall = time.monotonic() - t0
    stop.set()
    to_delete.put(None)
    threads[1].join(60)
    return outcomes, wall


def account(outcomes: dict[str, Outcome], total_gpus: int) -> tuple[float, float, int, int, int]:
    """Unallocated GPU % when arrived GPU requests reach 100% and at the end (130%),
    in commit order; pods skipped by 100% and in all."""
    order = sorted(outcomes.values(), key=lambda o: o.rv)
    arrived = alloc = skipped = 0
    at100: tuple[float, int] | None = None
    for o in order:
        arrived += o.gpus
        if o.node is not None:
            alloc += o.gpus
        else:
            skipped += 1
        if at100 is None and arrived >= total_gpus:
            at100 = (100.0 * (total_gpus - alloc) / total_gpus, skipped)
    assert at100 is not None
    late = sum(o.late for o in order)
    return at100[0], 100.0 * (total_gpus - alloc) / total_gpus, at100[1], skipped, late


def skipped_by_100(
    outcomes: dict[str, Outcome], seq: list[PodRow], total_gpus: int
) -> list[list[int]]:
    """The pods skipped before 100% arrived, as [GPUs, CPU milli, memory MiB]: which
    shapes a configuration turned away (the figures say only how many GPUs)."""
    arrived, out = 0, []
    for name, o in sorted(outcomes.items(), key=lambda no: no[1].rv):
        if arrived >= total_gpus:
            break
        arrived += o.gpus
        if o.node is None:
            row = seq[int(name[1:])]
            out.append([row.gpus, row.cpu_milli, row.memory_mib])
    return out


# -- the table ----------------------------------------------------------------------


def load_optimum(path: Path = OPTIMUM_JSON) -> dict[tuple[str, int], float]:
    """bench/optimum's committed figures by (pod list, seed): the unallocated GPU % at
    100% arrived that no placement of the same pods goes below."""
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return {
        (pod_list, int(seed)): float(fig["unalloc_bound_pct"])
        for pod_list, seeds in data.items()
        for seed, fig in seeds.items()
    }


def summarize(results: list[RunResult], optimum: dict[tuple[str, int], float] | None = None) -> str:
    """The table; with `optimum` (load_optimum), rows whose every seed has a figure
    gain the optimum and the gap to it at 100% arrived, in points."""

    def cell(vals: list[float], fmt: str) -> str:
        m = statistics.fmean(vals)
        if len(vals) == 1:
            return format(m, fmt)
        return f"{format(m, fmt)} [{format(min(vals), fmt)}-{format(max(vals), fmt)}]"

    rows: list[tuple[str, ...]] = [
        (
            "pod list",
            "config",
            "seeds",
            "unalloc GPU % @100%",
            "unalloc GPU % @130%",
            "skipped @100%",
            "skipped @130%",
            "wall s",
            "pods/s",
        )
    ]
    optimum = optimum or {}
    if any((r.pod_list, r.seed) in optimum for r in results):
        rows[0] += ("optimum %", "gap (points)")
    keys: list[tuple[str, str]] = []
    for r in results:
        if (r.pod_list, r.config) not in keys:
            keys.append((r.pod_list, r.config))
    for pl, cfg in keys:
        rs = [r for r in results if (r.pod_list, r.config) == (pl, cfg)]
        rows.append(
            (
                pl,
                cfg,
                ",".join(str(r.seed) for r in rs),
                cell([r.unalloc_100 for r in rs], ".2f"),
                cell([r.unalloc_130 for r in rs], ".2f"),
                cell([r.skipped_100 for r in rs], ".0f"),
                cell([r.skipped for r in rs], ".0f"),
                cell([r.wall_s for r in rs], ".0f"),
                cell([r.pods_per_s for r in rs], ".0f"),
            )
        )
        if len(rows[0]) > len(rows[-1]):
            opt = [optimum.get((r.pod_list, r.seed)) for r in rs]
            if all(o is not None for o in opt):
                best = [o for o in opt if o is not None]
                gap = [r.unalloc_100 - o for r, o in zip(rs, best, strict=True)]
                rows[-1] += (cell(best, ".2f"), cell(gap, ".2f"))
            else:
                rows[-1] += ("-", "-")
    return table(rows[0], rows[1:])


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--fast", action="store_true", help="one list (multigpu50), one seed")
    ap.add_argument("--lists", default="default,multigpu50", help="names or CSV paths")
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--window", type=int, default=32, help="pods created ahead (>= 1)")
    ap.add_argument("--nodes", default=str(TRACES / NODE_LIST), help="node list CSV")
    ap.add_argument("--json", help="also write every run's figures here")
    ap.add_argument("--keep", action="store_true", help="keep the work dir (logs, configs)")
    ap.add_argument("--table", nargs="+", metavar="JSON", help="only print the table of saved runs")
    ap.add_argument("--pin", type=float, default=0.0, metavar="FRACTION",
                    help="pin this share of GPU pods to GPU models (PIN_SETS)")  # fmt: skip
    args = ap.parse_args()
    if args.table:
        missing = [f for f in args.table if not Path(f).is_file()]
        if missing:
            ap.error(f"no such file: {missing[0]}")
        saved = [
            RunResult(**{k: v for k, v in r.items() if k != "pods_per_s"})
            for f in args.table
            for r in json.loads(Path(f).read_text())
        ]
        order = {c: i for i, c in enumerate(CONFIGS + VARIANTS)}
        saved.sort(key=lambda r: (r.pod_list, order.get(r.config, 99), r.seed))
        print(summarize(saved, load_optimum()))
        return 0
    if args.fast:
        args.lists, args.seeds = "multigpu50", "1"
    configs = [c for c in args.configs.split(",") if c]
    bad = [c for c in configs if c not in CONFIGS + VARIANTS]
    if bad or args.window < 1:
        ap.error(f"unknown config(s) {bad}" if bad else "--window must be >= 1")
    seeds = [int(s) for s in args.seeds.split(",") if s]
    lists = pod_lists(args.lists, ap)

    agent_cfg = load_config(None, environ={}, overrides={})
    prefix = agent_cfg.labels.prefix
    lease_ns = agent_cfg.kubernetes.lease_namespace
    nodes = read_nodes(Path(args.nodes))
    total = sum(n.gpus for n in nodes)
    products = product_values(prefix)
    workdir = Path(tempfile.mkdtemp(prefix="bench-openb-"))
    cp = ControlPlane(tools_bin("k8s", "etcd"), workdir)
    procs = Processes(cp, workdir)
    results: list[RunResult] = []
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    try:
        cp.start()
        api = Api(cp)
        t = time.monotonic()
        build_cluster(api, nodes, prefix, lease_ns)
        print(
            f"cluster: {len(nodes)} nodes, {total} GPUs, built in "
            f"{time.monotonic() - t:.0f} s; workdir {workdir}",
            file=sys.stderr,
        )
        for list_name, path in lists.items():
            pods = read_pods(path)
            if args.pin:
                pods = pin_models(pods, nodes, args.pin)
                list_name = f"{list_name}+pin{args.pin:g}"
            for seed in seeds:
                seq = arrivals(pods, seed, total)
                for config in configs:
                    label = f"{list_name}-{seed}-{config}"
                    renew_leases(api, nodes, lease_ns)
                    url = None
                    if config not in ("default", "mostallocated"):
                        url = procs.extender(config, label)
                    sched = procs.scheduler(config, label, url)
                    outcomes, wall = run_once(
                        api, seq, sched, products, prefix, total, args.window, label
                    )
                    procs.stop()
                    u100, u130, s100, s130, late = account(outcomes, total)
                    r = RunResult(
                        config, list_name, seed, len(seq), u100, u130, s100, s130, wall, late,
                        args.window, {"skipped_100": skipped_by_100(outcomes, seq, total)},
                    )  # fmt: skip
                    results.append(r)
                    if args.json:  # after every run: an interrupted bench keeps its figures
                        Path(args.json).write_text(
                            json.dumps(
                                [{**x.__dict__, "pods_per_s": x.pods_per_s} for x in results],
                                indent=1,
                            )
                        )
                    print(
                        f"  {label}: unalloc {u100:.2f}% @100, {u130:.2f}% @130, "
                        f"skipped {s130}, late {late}, {wall:.0f} s",
                        file=sys.stderr,
                    )
                    clear_pods(api)
    finally:
        procs.stop()
        cp.stop()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    print(
        f"bench/openb  {started}  window {args.window}  "
        f"{platform.node()} {os.cpu_count()} cpu, Python {platform.python_version()}"
    )
    print(f"cluster {len(nodes)} nodes / {total} GPUs; mean [min-max] over seeds")
    print(summarize(results, load_optimum()))
    late = sum(r.late_binds for r in results)
    if late:
        print(f"late binds (placed after being reported unschedulable): {late}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
