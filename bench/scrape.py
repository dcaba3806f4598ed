"""bench/scrape: what one Prometheus scrape costs, and what the agent costs at idle.

1. Render time of one /metrics body through the agent's own WSGI app (everything a
   scrape costs but the socket), text and OpenMetrics, for 8 GPUs (dgx-h100) and
   8 GPUs x 7 MIG instances (a100-mig): "after a poll" encodes every GPU series,
   "cached" is a scrape between two polls of the same snapshot.
2. A real `gpudaemon run --simulate dgx-h100` subprocess polling telemetry at 1 Hz,
   scraped every 15 s, for --seconds (default 60): CPU share and RSS from /proc.

Prints a table with the brief's targets beside each figure. Usage:
    scripts/bench scrape [--seconds 60] [--iterations 2000]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from prometheus_client import CollectorRegistry

from bench.table import print_table
from gpudaemon.agent.cache import Cache
from gpudaemon.agent.metrics.collector import GpuCollector
from gpudaemon.agent.metrics.http import make_app
from gpudaemon.agent.metrics.selfmetrics import AgentMetrics
from gpudaemon.backends.simulated import SimulatedBackend, load_profile
from tests.support import free_port, http_get, start_agent, stop, wait_for

REPO = Path(__file__).resolve().parent.parent

CLK_TCK = os.sysconf("SC_CLK_TCK")


def render_times(profile: str, iterations: int, accept: str) -> dict[str, float]:
    """ms per /metrics body through the agent's WSGI app (no socket): `cold` after a
    new telemetry poll (every GPU series encoded), `warm` between polls (GPU part
    cached). Returns median/p99 for both, plus series count and body size."""
    backend = SimulatedBackend(load_profile(profile), seed=0)
    cache = Cache()
    cache.put_inventory(backend.inventory())
    cache.put_samples(backend.sample())
    reg = CollectorRegistry()
    metrics = AgentMetrics(reg)
    metrics.set_build("simulated")
    for job in ("telemetry", "inventory", "labels", "pods"):
        metrics.poll_duration_seconds.labels(job).observe(0.001)
    gpus = GpuCollector(cache, "bench-node")
    full = CollectorRegistry()
    full.register(reg)
    full.register(gpus)
    app = make_app(full, lambda: (True, "ok"), gpus, reg)
    env = {"PATH_INFO": "/metrics", "QUERY_STRING": "", "HTTP_ACCEPT": accept}

    def scrape() -> bytes:
        return b"".join(app(dict(env), lambda *a: None))

    samples = backend.sample()
    body = scrape()
    out: dict[str, float] = {}
    for mode in ("cold", "warm"):
        for _ in range(20):
            scrape()
        times = []
        for _ in range(iterations):
            if mode == "cold":
                cache.put_samples(samples)  # a new snapshot, as after each poll
            t0 = time.perf_counter()
            scrape()
            times.append(time.perf_counter() - t0)
        times.sort()
        out[mode] = statistics.median(times) * 1e3
        out[mode + "_p99"] = times[int(len(times) * 0.99)] * 1e3
    out["series"] = sum(1 for ln in body.splitlines() if ln and not ln.startswith(b"#"))
    out["kib"] = len(body) / 1024
    return out


def proc_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime


def proc_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def idle_cost(seconds: float) -> tuple[float, float, float, float, int]:
    """CPU % of one core, RSS at start/end/max in MiB, scrapes done."""
    work = Path(tempfile.mkdtemp(prefix="bench-scrape-"))
    cfg = work / "cfg.yaml"
    cfg.write_text(
        "schedules: {telemetry: '* * * * * *', labels: '*/30 * * * * *'}\n"
        f"metrics: {{pod_resources_socket: '{work / 'kubelet.sock'}'}}\n"
    )
    port = free_port()
    proc = start_agent(
        [
            "run",
            "--config",
            str(cfg),
            "--simulate",
            "dgx-h100",
            "--node-name",
            "bench",
            "--listen",
            f"127.0.0.1:{port}",
            "--labels-to",
            str(work / "labels.json"),
        ],
        log=work / "agent.log",
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: http_get(url + "/readyz")[0] == 200, 30, what="agent ready")
        time.sleep(5)  # let imports and the first cycles settle
        cpu0, t0 = proc_cpu_seconds(proc.pid), time.monotonic()
        rss0 = rss_max = proc_rss_mib(proc.pid)
        scrapes, next_scrape = 0, t0
        while (now := time.monotonic()) - t0 < seconds:
            if now >= next_scrape:
                assert http_get(url + "/metrics")[0] == 200
                scrapes += 1
                next_scrape += 15
            rss_max = max(rss_max, proc_rss_mib(proc.pid))
            time.sleep(0.5)
        cpu1, t1 = proc_cpu_seconds(proc.pid), time.monotonic()
        rss1 = proc_rss_mib(proc.pid)
    finally:
        stop(proc)
    return 100 * (cpu1 - cpu0) / (t1 - t0), rss0, rss1, rss_max, scrapes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--iterations", type=int, default=2000)
    args = ap.parse_args()

    print(
        f"bench/scrape  {time.strftime('%Y-%m-%d %H:%M %Z')}  {platform.node()}  "
        f"{platform.processor() or platform.machine()}  cores={os.cpu_count()}  "
        f"python {platform.python_version()}"
    )
    rows = []
    for label, profile, target in (
        ("8 GPUs (dgx-h100)", "dgx-h100", 2.0),
        ("8x7 MIG (a100-mig)", "a100-mig", 10.0),
    ):
        for fmt, accept in (("text", ""), ("OpenMetrics", "application/openmetrics-text")):
            r = render_times(profile, args.iterations, accept)
            for mode, what in (("cold", "after a poll"), ("warm", "cached")):
                ok = "ok" if r[mode] <= target else "MISS"
                rows.append(
                    (
                        f"scrape {label}, {fmt}, {what}",
                        f"{r[mode]:.3f} ms (p99 {r[mode + '_p99']:.3f})",
                        f"<= {target:g} ms",
                        ok,
                    )
                )
        rows.append(
            (f"scrape {label}, body", f"{r['series']:.0f} series, {r['kib']:.1f} KiB", "", "")
        )
    cpu, rss0, rss1, rss_max, scrapes = idle_cost(args.seconds)
    rows.append(
        (
            f"idle CPU, 8 GPUs @1 Hz, {scrapes} scrapes/{args.seconds:.0f}s",
            f"{cpu:.2f} % of a core",
            "<= 1 %",
            "ok" if cpu <= 1 else "MISS",
        )
    )
    rows.append(
        ("idle RSS, max", f"{rss_max:.1f} MiB", "<= 80 MiB", "ok" if rss_max <= 80 else "MISS")
    )
    rows.append(("idle RSS, start -> end", f"{rss0:.1f} -> {rss1:.1f} MiB", "no growth", ""))

    print_table(("measure", "result", "target", ""), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
