"""bench/rebalancer: what one rebalancer pass costs on a large fleet.

A fragmented fleet of N nodes of 8 GPUs: on each, six opted-in 1-GPU pods of a
Deployment (2 GPUs free, so an 8-GPU pod fits nowhere), and on a tenth of them two
more GPUs held by pods that may not move. Pending 8-GPU pods the scheduler found no
room for wait. Two measurements:

1. **plan**: planning room for one pending pod, `planner.defragment` (candidate nodes
   ranked by cost, each signature's hosts ranked once per pass) beside `exhaustive`
   (tests/unit/rebalancer/fleet.py), the first version's search (every node's plan
   tried, and every evicted pod scored against every node), the baseline. Both must
   return the same plan. The baseline is skipped above `--baseline-max` nodes (it
   grows with the square).
2. **pass**: `Rebalancer.run_pass()` in dry run (planning, Events to a null API) with
   `--pending` pending pods, of which one can be planned (the others ask for GPU
   models no node has); and the same when nothing can move (every pod pinned). (The
   rebalancer process's memory at 5,000 nodes, off a real API server: bench/fleet.)

  scripts/bench rebalancer [--nodes 100,1000,5000] [--pending 10] [--baseline-max 1000]
"""

from __future__ import annotations

import argparse
import platform
import time
from typing import Any

from bench.table import print_table
from gpudaemon.rebalancer.app import Rebalancer
from gpudaemon.rebalancer.planner import defragment
from tests.unit.rebalancer.fleet import exhaustive, node, planner_inputs, pod, rebalancer


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
