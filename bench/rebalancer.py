"""bench/rebalancer: what one rebalancer pass costs on a large fleet.

A fragmented fleet of N nodes of 8 GPUs: on each, six opted-in 1-GPU pods of a
Deployment (2 GPUs free, so an 8-GPU pod fits nowhere), and on a tenth of them two
more GPUs held by pods that may not move. Pending 8-GPU pods the scheduler found no
room for wait. Two measurements:

1. **plan**: planning room for one pending pod, `planner.defragment` (candidate nodes
   ranked by cost, each signature's hosts ranked once per pass) beside `exhaustive`
   below, the first version's search (every node's plan tried, and every evicted pod
   scored against every node), the baseline. Both must return the same plan. The
   baseline is skipped above `--baseline-max` nodes (it grows with the square).
2. **pass**: `Rebalancer.run_pass()` in dry run (planning, Events to a null API) with
   `--pending` pending pods, of which one can be planned (the others ask for GPU
   models no node has); and the same when nothing can move (every pod pinned). (The
   rebalancer process's memory at 5,000 nodes, off a real API server: bench/fleet.)

  scripts/bench rebalancer [--nodes 100,1000,5000] [--pending 10] [--baseline-max 1000]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry

from bench.extender import lease_obj, node_obj, pod_obj
from bench.table import print_table
from gpudaemon.cluster.policies.base import Policy
from gpudaemon.cluster.scoring import check_node
from gpudaemon.cluster.state import NodeState
from gpudaemon.config import Config
from gpudaemon.rebalancer.app import Rebalancer
from gpudaemon.rebalancer.planner import (
    NodeFacts,
    Placer,
    Plan,
    PodFacts,
    _without,
    defragment,
    may_land,
)
from tests.unit.rebalancer.fake_kube import FakeKube  # the API calls of a dry-run pass

P = "gpudaemon.io/"
OWNER = [{"kind": "ReplicaSet", "name": "rs", "controller": True, "uid": "rs"}]


def exhaustive(
    pending: PodFacts,
    states: Mapping[str, NodeState | None],
    fresh: Mapping[str, bool],
    facts: Mapping[str, NodeFacts],
    running: Mapping[str, Sequence[PodFacts]],
    policy: Policy,
) -> Plan | None:
    """The first version's search, kept as the baseline and as the tests' oracle
    (tests/property/test_defragment.py): every node's plan, each evicted pod placed by
    scoring every node."""
    if pending.shape.gpus <= 0 or pending.shape.mig or pending.cannot_judge:
        return None
    if pending.gang or not pending.unschedulable:
        return None
    if Placer(states, fresh, facts, policy, running).fits_now(pending):
        return None
    best: Plan | None = None
    for node, st in sorted(states.items()):
        if st is None or not fresh.get(node, False) or not may_land(pending, facts.get(node)):
            continue
        if check_node(st, type(pending.shape)(0), fresh=True) is not None:
            continue
        if st.gpus_allocatable - st.gpus_unhealthy < pending.shape.gpus:
            continue
        need = pending.shape.gpus - st.gpus_free
        movable = sorted(
            (p for p in running.get(node, ())
             if p.opted_in and p.owned and not p.cannot_judge and not p.terminating
             and p.priority <= pending.priority and p.shape.gpus > 0 and not p.shape.mig),
            key=lambda p: (-p.shape.gpus, p.key),
        )  # fmt: skip
        victims: list[PodFacts] = []
        for p in movable:
            if sum(v.shape.gpus for v in victims) >= need:
                break
            victims.append(p)
        if sum(v.shape.gpus for v in victims) < need:
            continue
        if not _without(st, victims).can_host(pending.shape):
            continue
        sim = {n: s for n, s in states.items() if s is not None and n != node}
        targets: list[str] | None = []
        for v in victims:
            scored = {
                n: policy.raw_score(s, v.shape)
                for n, s in sim.items()
                if check_node(s, v.shape, fresh=fresh.get(n, False)) is None
                and s.can_host(v.shape)
                and may_land(v, facts.get(n))
            }
            if not scored:
                targets = None
                break
            top = max(scored.values())
            chosen = min(n for n, sc in scored.items() if sc == top)
            sim[chosen] = sim[chosen].with_placed(v.shape)
            assert targets is not None
            targets.append(chosen)
        if targets is None:
            continue
        plan = Plan(pending, node, tuple(victims), tuple(targets))
        if best is None or plan.cost < best.cost:
            best = plan
    return best


def node(i: int, gpus: int = 8, product: str = "NVIDIA-H100-80GB-HBM3") -> dict[str, Any]:
    """bench/extender's Node, with `gpus` GPUs of `product`, all healthy."""
    entries = [{"index": g, "uuid": f"GPU-{i}-{g}", "memory_total_mib": 81559}
               for g in range(gpus)]  # fmt: skip
    labels = {P + "gpu.count": str(gpus), P + "gpu.healthy": str(gpus), P + "gpu.product": product}
    obj = node_obj(f"n{i:05d}", labels, {P + "gpus": json.dumps(entries)})
    alloc = {**obj["status"]["allocatable"], "nvidia.com/gpu": str(gpus)}
    obj["status"].update(capacity=alloc, allocatable=alloc)
    return obj


def pod(name: str, node_name: str, gpus: int, opt_in: bool, model: str = "") -> dict[str, Any]:
    """bench/extender's pod, owned by a ReplicaSet, opted in or not, pinned to a GPU
    model or not; without a node, pending and marked unschedulable by the scheduler."""
    obj = pod_obj(name, gpus, node_name)
    obj["metadata"]["ownerReferences"] = OWNER
    if opt_in:
        obj["metadata"]["annotations"] = {P + "rebalance": "true"}
    if model:
        obj["spec"]["nodeSelector"] = {P + "gpu.product": model}
    if not node_name:
        obj["status"] = {"phase": "Pending", "conditions": [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
             "lastTransitionTime": "2026-11-25T00:00:00Z"}]}  # fmt: skip
    return obj


def rebalancer(nodes: list[dict[str, Any]], running: list[dict[str, Any]],
               waiting: list[dict[str, Any]], policy: str = "binpack") -> Rebalancer:  # fmt: skip
    """A leading, synced dry-run rebalancer whose caches hold these objects."""
    cfg = Config.model_validate(
        {"node_name": "bench", "rebalance": {"dry_run": True}, "extender": {"policy": policy}}
    )
    rb = Rebalancer(cfg, "bench", client=FakeKube(), registry=CollectorRegistry())  # type: ignore[arg-type]
    rb.cluster.replace_nodes(nodes)
    rb.cluster.replace_pods(running)
    rb._pending_replace(waiting)
    rb.cluster.replace_leases([lease_obj(o["metadata"]["name"], o["metadata"]["uid"])
                               for o in nodes])  # fmt: skip
    assert rb.elector.try_acquire_or_renew()
    return rb


def planner_inputs(rb: Rebalancer, pending: PodFacts) -> tuple[Any, ...]:
    """defragment's arguments for `pending`, from the rebalancer's caches, as a pass
    takes them."""
    nodes, _, running = rb.facts()
    snap = rb.cluster.snapshot(list(nodes))
    by_node: dict[str, list[PodFacts]] = {}
    for p in running.values():
        by_node.setdefault(p.node, []).append(p)
    return (pending, snap.states, snap.fresh, nodes, by_node, rb.policy)


def fleet(n: int, pending: int, pinned: bool) -> Rebalancer:
    """The fragmented fleet of the docstring."""
    nodes = [node(i) for i in range(n)]
    running = []
    for i in range(n):
        running += [pod(f"p{i}-{j}", f"n{i:05d}", 1, opt_in=not pinned) for j in range(6)]
        if i % 10 == 0:
            running.append(pod(f"q{i}", f"n{i:05d}", 2, opt_in=False))
    waiting = [pod("big-0", "", 8, opt_in=False)]
    waiting += [pod(f"big-{k}", "", 8, opt_in=False, model="NVIDIA-B200")
                for k in range(1, pending)]  # fmt: skip
    return rebalancer(nodes, running, waiting)


def timed(fn: Any, reps: int) -> tuple[float, Any]:
    best, out = float("inf"), None
    for _ in range(reps):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default="100,1000,5000")
    ap.add_argument("--pending", type=int, default=10)
    ap.add_argument("--baseline-max", type=int, default=1000)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    from loguru import logger

    logger.remove()  # one INFO line per planned eviction would drown the table
    sizes = [int(x) for x in a.nodes.split(",")]
    print(f"bench/rebalancer: {platform.python_version()}, {platform.machine()}, "
          f"best of {a.reps}")  # fmt: skip

    plan_rows = []
    for n in sizes:
        rb = fleet(n, 1, pinned=False)
        args = planner_inputs(rb, next(iter(rb.pending.values())))
        new_s, plan = timed(lambda: defragment(*args), a.reps)  # noqa: B023
        assert plan is not None and len(plan.victims) == 6
        if n <= a.baseline_max:
            old_s, old = timed(lambda: exhaustive(*args), 1)  # noqa: B023
            assert old == plan, (old, plan)
            base, ratio = f"{old_s * 1e3:.1f}", f"{old_s / new_s:.0f}x"
        else:
            base, ratio = "not run", "-"
        plan_rows.append([n, f"{new_s * 1e3:.2f}", base, ratio])
    print_table(["nodes", "defragment ms", "exhaustive (baseline) ms", "speed-up"], plan_rows,
                "1. plan room for one 8-GPU pod (same plan from both)")  # fmt: skip

    pass_rows = []
    for n in sizes:
        for pinned in (False, True):
            rb = fleet(n, a.pending, pinned)

            def one_pass(rb: Rebalancer = rb) -> float:
                rb.passes.made_room_for.clear()
                rb.run_pass()
                return rb.metrics.evictions.labels("defrag", "planned")._value.get()

            s, planned = timed(one_pass, a.reps)
            what = "every pod pinned: nothing can move" if pinned else "one plan (6 evictions)"
            pass_rows.append([n, a.pending, what, f"{s * 1e3:.1f}", int(planned)])
    print_table(["nodes", "pending pods", "fleet", "pass ms", "planned evictions (total)"],
                pass_rows, "2. one dry-run pass")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
