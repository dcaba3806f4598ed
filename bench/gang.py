"""bench/gang: gang jobs with and without gang scheduling, on a real control plane.

A stream of gangs larger than the cluster's free capacity (default: 10 gangs of 3 pods x
8 GPUs = 240 GPUs asked of 8 nodes x 8 GPUs = 64) is created at once, each gang a
PodGroup and its pods, the pods interleaved across
gangs as concurrent Job controllers create them (`--order grouped`: gang by gang),
against the real `gpudaemon extender` process and either

- kube-scheduler with the extender (the shipped example config): no gang semantics, pods
  placed one at a time; or
- the scheduler-plugins kube-scheduler with Coscheduling and the extender, configured as
  the chart renders it with `scheduler.gang.mode=coscheduling` (scheduler-plugins
  PodGroups, pods labelled scheduling.x-k8s.io/pod-group); or
- the stock kube-scheduler with Kubernetes' own GangScheduling and the extender, as the
  chart renders it with `scheduler.gang.mode=workload` (its config and --feature-gates):
  a Workload and a scheduling.k8s.io/v1beta1 PodGroup per gang, pods naming it in
  spec.schedulingGroup. The API server serves that API for every run.

Same pods, same nodes (a fresh set per run), same extender. When no pod has been bound
for `--quiet` seconds, the run ends and the table reports the share of the cluster's GPUs
held by partly placed gangs (useless until the rest arrive, and the seed of deadlock),
the share in complete gangs, and the time from creation to a gang's last binding.

  scripts/bench gang [--gangs 10] [--size 3] [--gpus 8] [--nodes 8] [--quiet 20]
                     [--order interleaved|grouped]
"""

from __future__ import annotations

import argparse
import http.client
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

from bench.extender import SCHED_CONFIG, agent_metadata
from bench.table import print_table
from tests.kubeobjects import lease_obj, node_obj, pod_obj

REPO = Path(__file__).resolve().parent.parent
GANG_LABEL = "scheduling.x-k8s.io/pod-group"
TIMEOUT_S = 10  # each PodGroup's scheduleTimeoutSeconds


WORKLOAD_API = "/apis/scheduling.k8s.io/v1beta1/namespaces/default"
APISERVER_ARGS = ("--feature-gates=GenericWorkload=true",
                  "--runtime-config=scheduling.k8s.io/v1beta1=true")  # fmt: skip


def gang_config(helm: Path, mode: str) -> tuple[dict[str, Any], list[str]]:
    """The chart's scheduler config and kube-scheduler --feature-gates for `mode`."""
    out = []
    for show in ("configmap", "deployment"):
        proc = subprocess.run(
            [str(helm), "template", "gpudaemon", str(REPO / "deploy/helm/gpudaemon"),
             "--set", f"scheduler.gang.mode={mode}",
             "--set", "image.repository=registry.example.com/gpudaemon",
             "--show-only", f"templates/scheduler/{show}.yaml"],
            capture_output=True, text=True, check=True, timeout=120,
        )  # fmt: skip
        out.append(yaml.safe_load(proc.stdout))
    conf = dict(yaml.safe_load(out[0]["data"]["config.yaml"]))
    sched = out[1]["spec"]["template"]["spec"]["containers"][0]
    return conf, [a for a in sched["command"] if a.startswith("--feature-gates=")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/bench gang", description=__doc__.splitlines()[0])
    ap.add_argument("--gangs", type=int, default=10)
    ap.add_argument("--size", type=int, default=3, help="pods per gang (its minMember)")
    ap.add_argument("--gpus", type=int, default=8, help="GPUs per pod")
    ap.add_argument("--order", choices=["interleaved", "grouped"], default="interleaved")
    ap.add_argument("--nodes", type=int, default=8, help="8-GPU nodes per run")
    ap.add_argument(
        "--quiet", type=float, default=20.0, help="end a run after this long without a binding"
    )
    args = ap.parse_args(argv)

    from tests.integration.kube.controlplane import ControlPlane
    from tests.support import free_port, tools_bin, wait_for

    bin_dir = tools_bin("k8s", "etcd", "helm", "scheduler-plugins")
    cp = ControlPlane(bin_dir, apiserver_args=APISERVER_ARGS)
    procs: list[subprocess.Popen[bytes]] = []
    rows: list[list[str]] = []
    try:
        cp.start()
        admin = cp.admin
        ns = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "gpudaemon"}}
        admin.request("POST", "/api/v1/namespaces", body=ns)
        crd = yaml.safe_load((bin_dir / "scheduling.x-k8s.io_podgroups.yaml").read_text())
        admin.request("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", body=crd)
        podgroups = "/apis/scheduling.x-k8s.io/v1alpha1/namespaces/default/podgroups"
        wait_for(lambda: admin.request("GET", podgroups), timeout=30, what="the PodGroup API")
        labels, ann = agent_metadata(0)
        pool = ThreadPoolExecutor(8)

        ext_port = free_port()
        ext_cfg = cp.dir / "extender.yaml"
        ext_cfg.write_text(yaml.safe_dump({
            "kubernetes": {"kubeconfig": str(cp.admin_kubeconfig)},
            "extender": {"listen": f"127.0.0.1:{ext_port}", "policy": "binpack"},
            "logging": {"level": "WARNING"},
        }))  # fmt: skip
        ext = subprocess.Popen(
            [sys.executable, "-m", "gpudaemon", "extender", "--config", str(ext_cfg)], cwd=REPO
        )
        procs.append(ext)

        def ready() -> bool:
            c = http.client.HTTPConnection("127.0.0.1", ext_port, timeout=2)
            c.request("GET", "/readyz")
            return c.getresponse().status == 200

        wait_for(ready, timeout=60, interval=0.2, what="extender caches synced")

        def run(label: str, mode: str) -> None:
            pool_label = {"bench-pool": label}
            nodes = [f"{label}-n{i}" for i in range(args.nodes)]

            def add(name: str) -> None:
                obj = node_obj(name, {**labels, **pool_label}, ann)
                created = admin.request("POST", "/api/v1/nodes", body=obj)
                admin.request("PATCH", f"/api/v1/nodes/{name}", body={"spec": {"taints": None}},
                              content_type="application/merge-patch+json")  # fmt: skip
                admin.request("POST", "/apis/coordination.k8s.io/v1/namespaces/gpudaemon/leases",
                              body=lease_obj(name, created["metadata"]["uid"]))  # fmt: skip

            list(pool.map(add, nodes))
            time.sleep(2)  # the extender's watch sees the nodes and Leases

            flags: list[str] = []
            if mode == "coscheduling":
                conf, flags = gang_config(bin_dir / "helm", mode)
                binary = "kube-scheduler-plugins"
            elif mode == "workload":
                conf, flags = gang_config(bin_dir / "helm", mode)
                binary = "kube-scheduler"
            else:
                conf, binary = yaml.safe_load(SCHED_CONFIG.read_text()), "kube-scheduler"
            conf["leaderElection"] = {"leaderElect": False}
            conf["clientConnection"] = {"kubeconfig": str(cp.admin_kubeconfig)}
            conf["extenders"][0]["urlPrefix"] = f"http://127.0.0.1:{ext_port}"
            path = cp.dir / f"{label}.yaml"
            path.write_text(yaml.safe_dump(conf))

            gangs: dict[str, list[str]] = {}
            t0 = time.monotonic()
            for g in range(args.gangs):
                pg = f"{label}-g{g:02d}"
                if mode == "workload":
                    policy = {"gang": {"minCount": args.size}}
                    template = {"name": "w", "schedulingPolicy": policy}
                    admin.request(
                        "POST", f"{WORKLOAD_API}/workloads",
                        body={"apiVersion": "scheduling.k8s.io/v1beta1", "kind": "Workload",
                              "metadata": {"name": pg},
                              "spec": {"podGroupTemplates": [template]}},
                    )  # fmt: skip
                    admin.request(
                        "POST", f"{WORKLOAD_API}/podgroups",
                        body={"apiVersion": "scheduling.k8s.io/v1beta1", "kind": "PodGroup",
                              "metadata": {"name": pg},
                              "spec": {"workloadRef": {"workloadName": pg, "templateName": "w"},
                                       "schedulingPolicy": policy}},
                    )  # fmt: skip
                else:
                    spec = {"minMember": args.size, "scheduleTimeoutSeconds": TIMEOUT_S}
                    admin.request(
                        "POST", podgroups,
                        body={"apiVersion": "scheduling.x-k8s.io/v1alpha1", "kind": "PodGroup",
                              "metadata": {"name": pg}, "spec": spec},
                    )  # fmt: skip
                gangs[pg] = [f"{pg}-p{i}" for i in range(args.size)]
            if args.order == "grouped":
                order = [(pg, n) for pg, names in gangs.items() for n in names]
            else:  # round-robin: one pod of each gang, then the next of each
                order = [(pg, gangs[pg][i]) for i in range(args.size) for pg in gangs]
            for pg, name in order:
                if mode == "workload":
                    body = pod_obj(name, args.gpus, labels={"bench-run": label})
                    body["spec"]["schedulingGroup"] = {"podGroupName": pg}
                else:
                    body = pod_obj(name, args.gpus, labels={GANG_LABEL: pg, "bench-run": label})
                body["spec"]["nodeSelector"] = pool_label
                admin.request("POST", "/api/v1/namespaces/default/pods", body=body)
            _, rv = admin.list_items(
                "/api/v1/namespaces/default/pods", {"labelSelector": f"bench-run={label}"}
            )
            bound_at: dict[str, float] = {}
            last = [time.monotonic()]
            stop = threading.Event()

            def watch() -> None:
                query = {"labelSelector": f"bench-run={label}"}
                while not stop.is_set():
                    for _kind, obj in admin.watch("/api/v1/namespaces/default/pods", rv, 60, query):
                        if obj["spec"].get("nodeName") and obj["metadata"]["name"] not in bound_at:
                            bound_at[obj["metadata"]["name"]] = last[0] = time.monotonic()
                        if stop.is_set():
                            return

            threading.Thread(target=watch, daemon=True).start()
            log = open(cp.dir / f"{label}.log", "wb")  # noqa: SIM115 - the child's
            p = subprocess.Popen(
                [str(bin_dir / binary), f"--config={path}", f"--secure-port={free_port()}",
                 "--bind-address=127.0.0.1", f"--authentication-kubeconfig={cp.admin_kubeconfig}",
                 f"--authorization-kubeconfig={cp.admin_kubeconfig}", "--v=1", *flags],
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
            procs.append(p)
            last[0] = time.monotonic()
            while time.monotonic() - last[0] < args.quiet and time.monotonic() - t0 < 600:
                time.sleep(0.5)
            stop.set()
            p.terminate()
            p.wait(10)
            total = args.nodes * 8
            complete = [g for g, pods in gangs.items() if all(n in bound_at for n in pods)]
            partial = [
                g for g, pods in gangs.items() if 0 < sum(n in bound_at for n in pods) < args.size
            ]
            held_partial = sum(args.gpus for g in partial for n in gangs[g] if n in bound_at)
            done_s = [max(bound_at[n] for n in gangs[g]) - t0 for g in complete]
            rows.append([
                f"{label} ({args.order})",
                f"{len(complete)}/{args.gangs}",
                str(len(partial)),
                f"{held_partial / total:.0%}",
                f"{len(complete) * args.size * args.gpus / total:.0%}",
                f"{min(done_s):.1f}" if done_s else "-",
                f"{statistics.median(done_s):.1f}" if done_s else "-",
            ])  # fmt: skip

        run("plain", "none")
        run("coscheduling", "coscheduling")
        run("workload", "workload")
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
        cp.stop()
    print(
        f"\n{args.gangs} gangs of {args.size} pods x {args.gpus} GPUs "
        f"({args.gangs * args.size * args.gpus} GPUs) on {args.nodes} x 8 = {args.nodes * 8} GPUs, "
        "real kube-apiserver, the gpudaemon extender (binpack) in every run"
    )
    print_table(
        ["scheduler", "complete gangs", "partial gangs", "GPUs held by partial gangs",
         "GPUs in complete gangs", "first full gang s", "median full gang s"],
        rows,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
