"""bench/spool: the InfluxDB spool's store, by measurement: the earlier segment files
(`seg-<n>.lp`, loaded from git at OLD_COMMIT) against the SQLite spool
(gpudaemon/history/spool.py), in one run, on the same disk and the same points.

For each store:
  1. append: one batch of 8 real points (a dgx-h100 history run, ~4 KiB) with its
     fsync, p50/p99 over --appends batches;
  2. replay: --outage batches (8640 = one day at 10 s) spooled, then read and
     deleted oldest first in ~1 MiB requests (no network), in points/s;
  3. size: bytes on disk per point after the outage, against the line-protocol bytes
     per point that spool_max_bytes counts;
  4. at the bound: appends into a spool full at --bound bytes (each drops the oldest),
     p50/p99, and the disk use there against the bound.
Prints a table.

  scripts/bench spool [--appends 2000] [--outage 8640] [--bound 16777216] [--dir DIR]
"""

from __future__ import annotations

import argparse
import platform
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.table import print_table
from gpudaemon.agent.cache import Cache
from gpudaemon.backends.simulated import SimulatedBackend, load_profile
from gpudaemon.history.lines import lines_for
from gpudaemon.history.spool import Spool

REPO = Path(__file__).resolve().parent.parent

OLD_COMMIT = "bd0db4f"  # the last commit with the segment spool
CHUNK = 1 << 20


def old_spool_class() -> Any:
    src = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{OLD_COMMIT}:gpudaemon/history/spool.py"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    mod = types.ModuleType("segment_spool")
    sys.modules["segment_spool"] = mod  # dataclasses look the module up
    exec(compile(src, "segment_spool.py", "exec"), mod.__dict__)
    return mod.Spool


def batches(n: int) -> list[list[str]]:
    clock = [1_700_000_000.0]
    backend = SimulatedBackend(load_profile("dgx-h100"), seed=3, clock=lambda: clock[0])
    cache = Cache(lambda: clock[0])
    cache.put_inventory(backend.inventory())
    out = []
    for _ in range(n):
        clock[0] += 10
        out.append(lines_for(cache.put_samples(backend.sample()), "gpu-node-0001"))
    return out


def pct(xs: list[float]) -> str:
    xs = sorted(xs)
    p99 = xs[min(len(xs) - 1, int(len(xs) * 0.99))]
    return f"p50 {statistics.median(xs) * 1000:.2f} ms, p99 {p99 * 1000:.2f} ms"


def disk_bytes(d: Path, suffix: str = "") -> int:
    """Allocated bytes of the files in `d` (whose names end with `suffix`)."""
    return sum(
        p.stat().st_blocks * 512 for p in d.iterdir() if p.is_file() and p.name.endswith(suffix)
    )


class Store:
    """The two spools behind one face: append a batch, replay everything."""

    def __init__(self, name: str, opener: Callable[[Path, int], Any]) -> None:
        self.name = name
        self.opener = opener

    def append(self, spool: Any, lines: list[str]) -> int:
        return int(spool.append(lines))

    def replay(self, spool: Any) -> int:
        n = 0
        if isinstance(spool, Spool):
            while (chunk := spool.oldest(CHUNK)) is not None:
                n += len(chunk.lines)
                spool.ack(chunk)
        else:
            while (seg := spool.oldest()) is not None:
                n += spool.read(seg).count(b"\n")
                spool.remove(seg)
        return n


def run(store: Store, root: Path, data: list[list[str]], a: argparse.Namespace) -> dict[str, str]:
    d = root / store.name
    out: dict[str, str] = {}
    spool = store.opener(d, 1 << 40)
    times = []
    for lines in data[: a.appends]:
        t = time.perf_counter()
        store.append(spool, lines)
        times.append(time.perf_counter() - t)
    out["append"] = pct(times)
    store.replay(spool)
    spool.close()

    spool = store.opener(d, 1 << 40)
    t = time.perf_counter()
    for lines in data[: a.outage]:
        store.append(spool, lines)
    fill = time.perf_counter() - t
    points = a.outage * 8
    payload = sum(len(x) + 1 for b in data[: a.outage] for x in b)
    on_disk = disk_bytes(d)
    wal = disk_bytes(d, "-wal")
    out["size"] = (
        f"{(on_disk - wal) / points:.0f} B/point on disk + {wal / 2**20:.1f} MiB WAL, "
        f"{payload / points:.0f} B/point counted; {on_disk / 2**20:.1f} MiB in all"
    )
    t = time.perf_counter()
    replayed = store.replay(spool)
    took = time.perf_counter() - t
    assert replayed == points, (replayed, points)
    out["replay"] = f"{points / took:,.0f} points/s ({took:.2f} s for one day; fill {fill:.1f} s)"
    spool.close()

    d2 = root / (store.name + "-bound")
    spool = store.opener(d2, a.bound)
    per_batch = payload / a.outage
    i = 0
    while i < int(a.bound / per_batch * 1.2):  # fill to the bound
        store.append(spool, data[i % len(data)])
        i += 1
    times, dropped = [], 0
    for k in range(a.appends):
        t = time.perf_counter()
        dropped += store.append(spool, data[(i + k) % len(data)])
        times.append(time.perf_counter() - t)
    out["bound_append"] = pct(times) + f" ({dropped} points dropped)"
    usage = disk_bytes(d2)
    out["bound_disk"] = f"{usage / 2**20:.2f} MiB on disk (x{usage / a.bound:.3f} of the bound)"
    spool.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--appends", type=int, default=2000)
    ap.add_argument("--outage", type=int, default=8640)
    ap.add_argument("--bound", type=int, default=16 << 20)
    ap.add_argument("--dir", default=None, help="where the spools go (default: a temp dir)")
    a = ap.parse_args()
    data = batches(max(a.outage, a.appends))
    stores = [Store("segments", old_spool_class()), Store("sqlite", Spool)]
    results = {}
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        fs = subprocess.run(
            ["df", "--output=fstype", tmp], capture_output=True, text=True
        ).stdout.split()[-1]
        for s in stores:
            results[s.name] = run(s, Path(tmp), data, a)
    print(
        f"bench/spool on {platform.machine()}, Python {platform.python_version()}, "
        f"SQLite {sqlite3.sqlite_version}, {fs}; {a.outage} batches of 8 points; "
        f"bound {a.bound >> 20} MiB"
    )
    rows = [
        ("append one batch, fsync", "append"),
        ("replay (read + delete)", "replay"),
        ("size per point", "size"),
        ("append at the bound (drops oldest)", "bound_append"),
        ("disk use at the bound", "bound_disk"),
    ]
    print_table(
        ("", *(s.name for s in stores)),
        [(label, *(results[s.name][key] for s in stores)) for label, key in rows],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
