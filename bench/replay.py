"""bench/replay: the openb arrivals through one policy in process, in seconds.

`bench/openb` is the measurement: the real kube-scheduler, API server and extender,
about five minutes a run on two cores. This replays the same arrivals (`arrivals`,
`pin_models`, the same node list) through a registered policy directly, with the rule
the chart's scheduler follows when in-tree scores do not differ
(tests/packing_replay.py).

It leaves out what only the real programs do: kube-scheduler's batching, retries of
unschedulable pods, and pods placed out of order. It is a screen for policy changes,
not a result: a figure goes in docs/benchmarks.md only from `bench/openb`. On the six
runs compared there (2026-11-27) it gave five of the real figures to the hundredth.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.openb import (
    NODE_LIST,
    TRACES,
    NodeRow,
    PodRow,
    arrivals,
    pin_models,
    pod_lists,
    read_nodes,
    read_pods,
)
from gpudaemon.cluster.policies.registry import known_policies
from tests.packing_replay import GPULESS, replay


@dataclass
class Replay:
    pod_list: str
    seed: int
    policy: str
    gpuless_pods: str
    unallocated_pct_100: float
    unallocated_pct_130: float
    skipped_100: list[list[int]]  # [GPUs, CPU milli, memory MiB] turned away by 100%
    seconds: float


def run(
    rows: list[NodeRow],
    pods: list[PodRow],
    seed: int,
    policy: str,
    gpuless: str,
    pin: float,
    name: str,
) -> Replay:
    t0 = time.monotonic()
    if pin:
        pods = pin_models(pods, rows, pin)
    seq = arrivals(pods, seed, sum(n.gpus for n in rows))
    at100, end, skipped = replay(rows, seq, seed, policy, gpuless)
    return Replay(
        name, seed, policy, gpuless, round(at100, 2), round(end, 2), skipped,
        round(time.monotonic() - t0, 1),
    )  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--lists", default="default,multigpu50", help="names or CSV paths")
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--policies", default="fragmentation-model")
    ap.add_argument("--gpuless-pods", default="full_nodes_first", help=",".join(GPULESS))
    ap.add_argument("--nodes", default=str(TRACES / NODE_LIST), help="node list CSV")
    ap.add_argument("--pin", type=float, default=0.0, metavar="FRACTION",
                    help="pin this share of GPU pods to GPU models (PIN_SETS)")  # fmt: skip
    ap.add_argument("--json", help="also write every replay's figures here")
    args = ap.parse_args()
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s]
    except ValueError:
        ap.error(f"--seeds: whole numbers, comma-separated (got {args.seeds!r})")
    policies = [p for p in args.policies.split(",") if p]
    gpuless = [g for g in args.gpuless_pods.split(",") if g]
    if bad := [p for p in policies if p not in known_policies()]:
        ap.error(f"unknown policy {bad[0]!r} (known: {', '.join(known_policies())})")
    if bad := [g for g in gpuless if g not in GPULESS]:
        ap.error(f"--gpuless-pods: unknown rule {bad[0]!r} (known: {', '.join(GPULESS)})")
    if not 0.0 <= args.pin <= 1.0:
        ap.error("--pin must be between 0 and 1")
    nodes = Path(args.nodes)
    if not nodes.is_file():
        ap.error(f"no node list {args.nodes!r}")
    rows = read_nodes(nodes)
    if not any(n.gpus > 0 for n in rows):
        ap.error(f"node list {args.nodes!r}: no node with a GPU")
    lists = {name: read_pods(path) for name, path in pod_lists(args.lists, ap).items()}
    for name, pods in lists.items():
        if not any(p.gpus > 0 for p in pods):
            ap.error(f"pod list {name!r}: no pod asking for a GPU")
    print(
        "| list | seed | policy | gpuless_pods | unallocated % at 100% (130%) | skipped by 100% |"
    )
    print("|---|---|---|---|---|---|")
    out = []
    for name, pods in lists.items():
        for seed in seeds:
            for pol in policies:
                for g in gpuless:
                    r = run(rows, pods, seed, pol, g, args.pin, name)
                    out.append(r)
                    print(
                        f"| {name} | {seed} | {pol} | {g} | {r.unallocated_pct_100:.2f} "
                        f"({r.unallocated_pct_130:.2f}) | {len(r.skipped_100)} |",
                        flush=True,
                    )
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in out], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
