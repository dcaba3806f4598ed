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
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from loguru import logger

from tests.integration.influx.rig import Clock, Rig
from tests.integration.influx.server import InfluxServer

REPO = Path(__file__).resolve().parent.parent


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
    tools = subprocess.run(
        [str(REPO / "scripts" / "test-tools"), "influxd"], capture_output=True, text=True
    )
    if tools.returncode != 0:
        print(tools.stderr, file=sys.stderr)
        return 1
    binary = Path(tools.stdout.strip().splitlines()[-1]) / "influxd"
    with tempfile.TemporaryDirectory() as tmp_:
        tmp = Path(tmp_)
        (tmp / "influxd").mkdir()
        server = InfluxServer(binary, tmp / "influxd")
        server.start()
        try:
            db = server.create_database("bench")
            rig = Rig(tmp, server.url, db, Clock())
            agent, writer = rig.agent, rig.writer

            def one() -> float:
                rig.clock.t += 10
                agent.poll_telemetry()
                start = time.perf_counter()
                writer.write(agent.cache.get())
                return time.perf_counter() - start

            steady = [one() for _ in range(a.cycles)]
            server.stop()
            outage = [one() for _ in range(a.outage_cycles)]
            assert writer.spool is not None
            spooled, spool_bytes = writer.spool.points, writer.spool.size_bytes
            server.start()
            runs, start = 0, time.perf_counter()
            while writer.spool.points:
                writer.write(agent.cache.get())  # the same reading again: replay only
                runs += 1
            drain = time.perf_counter() - start
            rig.close()
            stored = len(server.points(db, field="power_watts"))
        finally:
            server.stop()

    total = (a.cycles + a.outage_cycles) * 8
    print(f"bench/influx on {platform.machine()}, {platform.python_version()}, influxd 1.8.10")
    print("| what | result |")
    print("|---|---|")
    print(f"| history write, 8 GPUs, InfluxDB up ({a.cycles} runs) | {ms(steady)} |")
    print(
        "| history run, InfluxDB down: refused request + spool append with fsync "
        f"({a.outage_cycles} runs) | "
        f"{ms(outage)} |"
    )
    print(
        f"| spool size | {spool_bytes / a.outage_cycles:.0f} bytes per cycle, "
        f"{spool_bytes / 2**20:.1f} MiB for {a.outage_cycles} cycles ({spooled} points) |"
    )
    print(
        f"| replay of the outage | {runs} history runs, {drain:.1f} s, "
        f"{spooled / drain:.0f} points/s |"
    )
    print(f"| points in InfluxDB / taken | {stored} / {total} |")
    return 0 if stored == total else 1


if __name__ == "__main__":
    sys.exit(main())
