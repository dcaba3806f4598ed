"""bench/untrusted: what reading a node-written value costs (issue 28).

Times `decode_gpus` (size cap, bracket scan, orjson, typed fields) on the agent's own
values and on the worst hostile ones, each refused or read in bounded time; and one
relist of a 5,000-node fleet into the extender's ClusterState with and without one
poisoned node. Usage:
    scripts/bench untrusted [--iterations 200]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

from bench.table import print_table
from gpudaemon.cluster.clusterstate import ClusterState
from gpudaemon.errors import BadValueError
from gpudaemon.labels.annotations import decode_gpus
from tests.unit.extender.test_cluster import node_obj
from tests.unit.test_untrusted import largest_agent_value

P = "gpudaemon.io/"


def _time(fn: Callable[[], object], n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def _decode(text: str) -> str:
    try:
        decode_gpus(text)
        return "read"
    except BadValueError as e:
        return f"refused: {e.reason[:28]}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--iterations", type=int, default=200)
    n = ap.parse_args(argv).iterations
    typical = json.dumps(
        [{"index": i, "uuid": f"GPU-{i:08d}-bbbb-cccc-dddd-eeeeeeeeeeee",
          "memory_total_mib": 81559, "memory_used_mib": 40960, "utilization_pct": 60,
          "temperature_c": 55, "healthy": True, "processes": 1, "pods": ["ml/train-0"]}
         for i in range(8)], separators=(",", ":"))  # fmt: skip
    cases = {
        "8 GPUs, typical": typical,
        "8 GPUs x 7 MIG, longest names": largest_agent_value(),
        "64 KiB of nesting": "[" * 32_000 + "]" * 32_000,
        "1023 deep (orjson's limit)": "[" * 1023 + "]" * 1023,
        "60 KiB of escaped quotes": '"\\"' * 20_000,
        "wrong type in the last GPU": typical[:-2] + ',"healthy":"no"}]',
        "256 KiB string": "x" * 256 * 1024,
    }
    rows = []
    for name, text in cases.items():
        rows.append((name, f"{len(text.encode()):,}", _decode(text),
                     f"{_time(lambda t=text: _decode(t), n) * 1e6:,.0f}"))  # fmt: skip
    print_table(("value", "bytes", "result", "µs per decode"), rows,
                "decode_gpus on the agent's values and hostile ones")  # fmt: skip

    fleet = [node_obj(f"n{i}", uid=f"u{i}", util=[50] * 8) for i in range(5000)]
    bad = [*fleet[:-1], node_obj("n4999", uid="u4999")]
    bad[-1]["metadata"]["annotations"][P + "gpus"] = "[" * 32_000 + "]" * 32_000
    rows = []
    for name, items in (("5,000 nodes", fleet), ("5,000 nodes, one poisoned", bad)):
        c = ClusterState(P)
        t = _time(lambda items=items, c=c: c.replace_nodes(items), 3)  # type: ignore[misc]
        rows.append((name, f"{t * 1e3:,.0f}", len(c.bad_counts())))
    print_table(("relist", "ms", "bad keys"), rows, "ClusterState.replace_nodes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
