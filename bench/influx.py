"""bench/influx: what InfluxDB history costs, against a real influxd 1.8.10.

One in-process agent on simulated dgx-h100 GPUs (injected clock, 10 s cycles) and the
real InfluxWriter:
  1. steady state: time of one history write (8 points, one HTTP request);
  2. outage: time of one spool append (fsync) and spool bytes per cycle;
  3. recovery: how many history runs and seconds the replay needs to drain the
     outage, in points per second; then checks InfluxDB holds every point once.
Prints a table.

  scripts/bench influx [--cycles 200] [--outage-cycles 8640]   (8640 cycles = one day at 10 s)
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from loguru import logger
from prometheus_client import CollectorRegistry

from bench.table import print_table
from gpudaemon.agent.cache import Cache
from gpudaemon.agent.poller import Poller
from gpudaemon.backends.simulated import SimulatedBackend, load_profile
from gpudaemon.config import load_config
from gpudaemon.history.writer import InfluxWriter
from tests.clock import FakeClock
from tests.integration.influx.server import InfluxServer
from tests.support import tools_bin


def ms(xs: list[float]) -> str:
    xs = sorted(xs)
    p99 = xs[min(len(xs) - 1, int(len(xs) * 0.99))]
    return f"p50 {statistics.median(xs) * 1000:.2f} ms, p99 {p99 * 1000:.2f} ms"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cycles", type=int, default=200)
    ap.add_argument("--outage-cycles", type=int, default=8640)
    a = ap.parse_args()
    logger.remove()
    binary = tools_bin("influxd") / "influxd"
    with tempfile.TemporaryDirectory() as tmp_:
        tmp = Path(tmp_)
        (tmp / "influxd").mkdir()
        server = InfluxServer(binary, tmp / "influxd")
        server.start()
        try:
            db = server.create_database("bench")
            # The agent's own steps: the poller into the cache, the writer reading it.
            clock = FakeClock()
            cfg = load_config(
                environ={},
                overrides={
                    "node_name": "node-bench",
                    "influxdb": {
                        "url": server.url,
                        "bucket": f"{db}/autogen",
                        "spool_dir": str(tmp / "spool"),
                        "timeout_ms": 5000,
                    },
                },
            )
            cache = Cache(clock)
            poller = Poller(SimulatedBackend(load_profile("dgx-h100"), seed=5, clock=clock), cache)
            poller.inventory()
            writer = InfluxWriter(cfg, CollectorRegistry(), clock=clock)

            def one() -> float:
                clock.t += 10
                poller.telemetry()
                start = time.perf_counter()
                writer.write(cache.get())
                return time.perf_counter() - start

            steady = [one() for _ in range(a.cycles)]
            server.stop()
            outage = [one() for _ in range(a.outage_cycles)]
            assert writer.spool is not None
            spooled, spool_bytes = writer.spool.points, writer.spool.size_bytes
            server.start()
            runs, start = 0, time.perf_counter()
            while writer.spool.points:
                writer.write(cache.get())  # the same reading again: replay only
                runs += 1
            drain = time.perf_counter() - start
            writer.close()
            stored = len(server.points(db, field="power_watts"))
        finally:
            server.stop()

    total = (a.cycles + a.outage_cycles) * 8
    print_table(
        ("what", "result"),
        [
            (f"history write, 8 GPUs, InfluxDB up ({a.cycles} runs)", ms(steady)),
            (
                "history run, InfluxDB down: refused request + spool append with fsync "
                f"({a.outage_cycles} runs)",
                ms(outage),
            ),
            (
                "spool size",
                f"{spool_bytes / a.outage_cycles:.0f} bytes per cycle, "
                f"{spool_bytes / 2**20:.1f} MiB for {a.outage_cycles} cycles ({spooled} points)",
            ),
            (
                "replay of the outage",
                f"{runs} history runs, {drain:.1f} s, {spooled / drain:.0f} points/s",
            ),
            ("points in InfluxDB / taken", f"{stored} / {total}"),
        ],
        title=f"bench/influx on {platform.machine()}, {platform.python_version()}, influxd 1.8.10",
    )
    return 0 if stored == total else 1


if __name__ == "__main__":
    sys.exit(main())
