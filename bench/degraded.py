"""bench/degraded: what the healthy-GPU preference (issue 30) costs /filter and
/prioritize at 5,000 nodes, in process (the Framework's calls, no socket), as CPU time
per request (thread time: the 2-core test machine is shared, wall time is noise).

Cases: `clean` (no degraded GPU anywhere: the preference must cost nothing), and, when
this tree has it, `degraded` (a free degraded GPU on every 20th node: the tier is
built for every request). Run it in two trees to compare before and after:

  .venv/bin/python -m bench.degraded                       # this tree
  cd /tmp/old && PYTHONPATH=. /path/.venv/bin/python -m bench.degraded   # another

Prints one table; the median is what to compare.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from prometheus_client import CollectorRegistry

from bench.extender import P, agent_metadata, lease_obj, node_obj, pod_obj
from bench.table import print_table
from gpudaemon.cluster.clusterstate import ClusterState
from gpudaemon.config import load_config
from gpudaemon.extender.api import ExtenderApi
from gpudaemon.extender.app import make_policies


def cluster(n: int, degraded_every: int, rng: random.Random) -> ClusterState:
    c = ClusterState(P)
    meta = [agent_metadata(s) for s in range(8)]
    nodes, pods = [], []
    for i in range(n):
        name = f"node-{i:05d}"
        labels, ann = meta[i % len(meta)]
        ann = dict(ann)
        if degraded_every and i % degraded_every == 0:
            gpus = json.loads(ann[P + "gpus"])
            gpus[7].update(state="degraded", action="watch", reason="clock event hw_slowdown")
            ann[P + "gpus"] = json.dumps(gpus)
        nodes.append(node_obj(name, labels, ann))
        for j in range(rng.randint(0, 4)):
            pods.append(pod_obj(f"{name}-p{j}", rng.choice([1, 1, 2]), node=name))
    c.replace_nodes(nodes)
    c.replace_pods(pods)
    c.replace_leases([lease_obj(f"node-{i:05d}", f"node-{i:05d}") for i in range(n)])
    return c


def run(n: int, requests: int, degraded_every: int) -> list[list[str]]:
    rng = random.Random(1)
    cfg = load_config(None, environ={})
    c = cluster(n, degraded_every, rng)
    names = [f"node-{i:05d}" for i in range(n)]
    api = ExtenderApi(c, make_policies(cfg), cfg.extender.policy, CollectorRegistry(),
                      lambda: (True, "ok"), candidates=cfg.extender.candidates)  # fmt: skip
    fw = api.framework
    rows = []
    for verb in ("filter", "prioritize"):
        call = fw.filter if verb == "filter" else fw.score
        times = []
        for k in range(requests + 20):
            pod = pod_obj(f"b-{verb}-{k}", rng.choice([1, 2, 4, 8]))
            pod["metadata"]["uid"] = ""  # no assumptions left behind
            t0 = time.thread_time()
            call(pod, names)
            if k >= 20:
                times.append((time.thread_time() - t0) * 1000)
        case = "degraded" if degraded_every else "clean"
        med, mean = statistics.median(times), statistics.mean(times)
        rows.append([str(n), case, verb, f"{med:.2f}", f"{mean:.2f}"])
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=5000)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--clean-only", action="store_true", help="a tree without the preference")
    a = ap.parse_args()
    rows = run(a.nodes, a.requests, 0)
    if not a.clean_only:
        rows += run(a.nodes, a.requests, 20)
    print_table(
        ["nodes", "case", "verb", "median ms", "mean ms"],
        rows,
        "healthy-GPU preference: CPU ms per request, in process (fragmentation, candidates 10)",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
