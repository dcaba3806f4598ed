"""bench/optimum: the offline optimum of the openb bench, the floor under any scheduler.

For each pod list and seed, the pods of bench/openb's own arrival sequence (its
`read_nodes`, `read_pods` and `arrivals`, whole-GPU view) that have arrived when
arrived GPU requests reach 100% of the cluster's GPUs, the cut bench/openb reports.
The question, with full knowledge of every arrival: the most GPUs that any placement of
those pods allocates (each pod whole on one node or not at all; per node, gpus, cpu and
memory within allocatable; a pod with a `gpu_spec` only on a node of one of its
models). Unallocated GPU % = 100 x (GPUs - that maximum) / GPUs is a lower bound for
every scheduler.

Method (tests/packing_optimum.py): nodes and pods aggregated into types; a
configuration LP solved by column generation (HiGHS: scipy.optimize.linprog for the
master, a knapsack MILP per node type for pricing); its Lagrangian bound, floored to
whole GPUs, is the bound. Beside it, a real integer placement (the master over the
generated columns as a MILP, then best fit for what it left), checked node by node:
the optimum lies between the two.

  scripts/bench optimum [--lists default,multigpu50] [--seeds 1,2,3] [--json FILE]
                        [--write]   (--write: merge into bench/optimum.json, which
                                     bench/openb's table reads for its gap columns)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from bench.openb import (
    NODE_LIST,
    OPTIMUM_JSON,
    TRACES,
    PodRow,
    arrivals,
    pin_models,
    pod_lists,
    read_nodes,
    read_pods,
)
from bench.table import print_table
from tests.packing_optimum import node_types, pod_types, solve


def at_cut(seq: list[PodRow], total_gpus: int, fraction: float = 1.0) -> list[PodRow]:
    """The pods arrived when arrived GPU requests first reach `fraction` of the GPUs,
    that pod included: bench/openb's `account` takes its 100% figure at the same pod."""
    arrived = 0
    for i, p in enumerate(seq):
        arrived += p.gpus
        if arrived >= fraction * total_gpus:
            return seq[: i + 1]
    raise ValueError(f"only {arrived} GPUs arrived of {fraction * total_gpus:.0f}")


def one(
    list_name: str, path: Path, nodes_path: Path, seed: int, args: argparse.Namespace
) -> dict[str, Any]:
    nodes = read_nodes(nodes_path)
    total = sum(n.gpus for n in nodes)
    listed = read_pods(path)
    if args.pin:  # the same pinned list bench/openb --pin runs
        listed = pin_models(listed, nodes, args.pin)
        list_name = f"{list_name}+pin{args.pin:g}"
    pods = at_cut(arrivals(listed, seed, total), total)
    nts, pts = node_types(nodes), pod_types(pods)
    label = f"{list_name} seed {seed}"
    print(
        f"{label}: {len(pods)} pods arrived ({len(pts)} types), {len(nodes)} nodes "
        f"({len(nts)} types), {total} GPUs",
        file=sys.stderr,
    )
    sol = solve(
        nts,
        pts,
        time_limit_s=args.time_limit,
        milp_time_limit_s=args.milp_time_limit,
        progress=lambda m: print(f"  {label}: {m}", file=sys.stderr),
    )
    print(
        f"  {label}: bound {sol.bound_gpus}, placed {sol.placed_gpus} GPUs, {sol.seconds:.0f} s",
        file=sys.stderr,
    )
    return {
        "pod_list": list_name,
        "seed": seed,
        "pods": len(pods),
        "pod_types": len(pts),
        "total_gpus": total,
        "arrived_gpus": sum(p.gpus for p in pods),
        "lp_gpus": round(sol.lp_gpus, 3),
        "bound_gpus": sol.bound_gpus,
        "placed_gpus": sol.placed_gpus,
        "unalloc_bound_pct": round(sol.unallocated_bound_pct, 4),
        "unalloc_placed_pct": round(sol.unallocated_placed_pct, 4),
        "proven": sol.proven,
        "converged": sol.converged,
        "rounds": sol.rounds,
        "columns": sol.columns,
        "seconds": round(sol.seconds, 1),
    }


def write_optimum(rows: list[dict[str, Any]], path: Path = OPTIMUM_JSON) -> None:
    """Merge into the committed table: {list: {seed: figures}}, one entry per list/seed."""
    data: dict[str, dict[str, Any]] = json.loads(path.read_text()) if path.is_file() else {}
    for r in rows:
        data.setdefault(r["pod_list"], {})[str(r["seed"])] = {
            k: r[k]
            for k in ("unalloc_bound_pct", "unalloc_placed_pct", "bound_gpus", "placed_gpus",
                      "total_gpus", "pods", "proven")
        }  # fmt: skip
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(
        prog="scripts/bench optimum", description=(__doc__ or "").splitlines()[0]
    )
    ap.add_argument("--lists", default="default,multigpu50", help="names or CSV paths")
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--nodes", default=str(TRACES / NODE_LIST), help="node list CSV")
    ap.add_argument("--time-limit", type=float, default=300, help="column generation, s")
    ap.add_argument("--milp-time-limit", type=float, default=60, help="integer master, s")
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--write", action="store_true", help=f"merge into {OPTIMUM_JSON.name}")
    ap.add_argument("--pin", type=float, default=0.0, help="as bench/openb --pin")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",") if s]
    lists = pod_lists(args.lists, ap)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    t0 = time.monotonic()
    rows = [
        one(name, path, Path(args.nodes), s, args) for name, path in lists.items() for s in seeds
    ]
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    if args.write:
        write_optimum(rows)
    print(
        f"bench/optimum  {started}  {platform.node()} {os.cpu_count()} cpu, "
        f"Python {platform.python_version()}, {time.monotonic() - t0:.0f} s in all"
    )
    print("unallocated GPU % at 100% arrived: the optimum lies in [bound, placed]")
    print_table(
        ("pod list", "seed", "pods", "bound: unalloc %", "placed: unalloc %", "GPUs bound / placed",
         "proven", "rounds", "s"),
        [
            (r["pod_list"], r["seed"], r["pods"], f"{r['unalloc_bound_pct']:.2f}",
             f"{r['unalloc_placed_pct']:.2f}", f"{r['bound_gpus']} / {r['placed_gpus']}",
             "yes" if r["proven"] else "no", r["rounds"], f"{r['seconds']:.0f}")
            for r in rows
        ],
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
