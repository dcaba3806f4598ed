"""bench/poll: the agent's own cost per GPU per cycle, apart from time inside the backend,
and a full telemetry sample on simulated GPUs that cost what H100s cost.

For 1, 8 and 64 simulated GPUs it runs the real jobs (telemetry poll into the cache,
label reconcile) and subtracts the time spent inside the backend's calls, which on
real hardware is time inside NVML. The same runs on the `h100-measured` latency profile
(each NVML call takes its measured H100 mean) give the full telemetry sample as a node
would pay it, the energy read (its own schedule), and what a sample would cost with the
energy counter in it, as before. With a real GPU it also times a full NVML sample, the
energy read and `nvidia-smi --query-gpu=... --format=csv` side by side.

Usage: scripts/bench poll [--cycles N]
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import subprocess
import time
from datetime import UTC, datetime

from prometheus_client import CollectorRegistry

from bench.table import print_table
from gpudaemon.agent.cache import Cache
from gpudaemon.agent.metrics.selfmetrics import AgentMetrics
from gpudaemon.agent.poller import Poller
from gpudaemon.backends.simulated import SimulatedBackend, load_profile, parse_profile
from gpudaemon.labels import NodeLabeler
from gpudaemon.model import GpuSample, NodeInventory
from gpudaemon.schedule import Job, JobRunner

TARGET_MS = 0.3  # the agent's own cost per GPU per cycle
SAMPLE_TARGET_MS = 0.2  # a full telemetry sample on h100-measured, per GPU
SMI_FIELDS = (
    "index,uuid,name,utilization.gpu,utilization.memory,memory.used,memory.free,memory.total,"
    "temperature.gpu,power.draw,clocks.sm,clocks.mem,ecc.errors.corrected.volatile.total,"
    "ecc.errors.uncorrected.volatile.total"
)


class TimedBackend:
    """Wraps a backend and adds up the seconds spent inside it."""

    def __init__(self, inner: SimulatedBackend) -> None:
        self.inner = inner
        self.name = inner.name
        self.inside_s = 0.0

    def inventory(self) -> NodeInventory:
        t = time.perf_counter()
        try:
            return self.inner.inventory()
        finally:
            self.inside_s += time.perf_counter() - t

    def sample(self) -> tuple[GpuSample, ...]:
        t = time.perf_counter()
        try:
            return self.inner.sample()
        finally:
            self.inside_s += time.perf_counter() - t

    def energy(self) -> dict[int, float | None]:
        t = time.perf_counter()
        try:
            return self.inner.energy()
        finally:
            self.inside_s += time.perf_counter() - t

    def close(self) -> None:
        self.inner.close()


def profile(n: int, measured: bool = False) -> str:
    """n H100s; `measured`: with the per-call latencies and the backend's own work of
    the built-in h100-measured (what a real sample costs)."""
    spec = load_profile("h100-measured").gpus[0]
    latency = spec.nvml_latency_us if measured else {}
    overhead = spec.sample_overhead_us if measured else 0.0
    return (
        "gpus: [{name: NVIDIA H100 80GB HBM3, memory_total_mib: 81559,"
        f" compute_capability: '9.0', count: {n}, nvml_latency_us: {json.dumps(latency)},"
        f" sample_overhead_us: {overhead}}}]"
    )


def measure_measured(n: int, cycles: int) -> dict[str, float]:
    """On h100-measured latencies: a full telemetry poll (NVML + agent), the energy read,
    and a poll that also reads energy (the design before schedules.energy), ms per GPU."""
    cache = Cache()
    poller = Poller(SimulatedBackend(parse_profile(profile(n, measured=True)), seed=1), cache)
    poller.inventory()
    for _ in range(5):
        poller.telemetry()
    sample, energy, both = [], [], []
    for _ in range(cycles):
        t0 = time.perf_counter()
        poller.telemetry()
        t1 = time.perf_counter()
        poller.energy()
        t2 = time.perf_counter()
        sample.append(t1 - t0)
        energy.append(t2 - t1)
        both.append(t2 - t0)
    ms = 1000.0 / n
    return {
        "sample": statistics.median(sample) * ms,
        "energy": statistics.median(energy) * ms,
        "both": statistics.median(both) * ms,
    }


def measure(n: int, cycles: int) -> dict[str, float]:
    # The agent's own steps (app.py wires the same ones): the poller into the cache,
    # through the one job wrapper, and the label build.
    backend = TimedBackend(SimulatedBackend(parse_profile(profile(n)), seed=1))
    cache = Cache()
    poller, labeler = Poller(backend, cache), NodeLabeler()  # type: ignore[arg-type]
    runner = JobRunner(
        {
            "telemetry": Job("telemetry", "* * * * * *", poller.telemetry),
            "labels": Job("labels", "* * * * * *", lambda: labeler.build(cache.get())),
        },
        AgentMetrics(CollectorRegistry()),
    )
    poller.inventory()
    for _ in range(20):  # warm up
        runner.run("telemetry")
        runner.run("labels")
    poll, inside, labels = [], [], []
    for _ in range(cycles):
        backend.inside_s = 0.0
        t0 = time.perf_counter()
        runner.run("telemetry")
        t1 = time.perf_counter()
        runner.run("labels")
        t2 = time.perf_counter()
        poll.append(t1 - t0)
        inside.append(backend.inside_s)
        labels.append(t2 - t1)
    ms = 1000.0 / n

    def med(xs: list[float]) -> float:
        return statistics.median(xs) * ms

    overhead = [p - i for p, i in zip(poll, inside, strict=True)]
    return {
        "backend": med(inside),
        "poll": med(overhead),
        "labels": med(labels),
        "total": med([o + lb for o, lb in zip(overhead, labels, strict=True)]),
    }


def measure_whole_job(n: int, cycles: int, cadence_s: float) -> dict[str, float]:
    """The whole telemetry job as the running agent has it (the job app.py wires: the
    poller into the cache, then the quarantine check, through the one JobRunner and its
    duration metric) on h100-measured latencies, ms per GPU: in a tight loop, and once
    every `cadence_s` with the process idle in between (the default cadence is once a
    second). Wall time from the agent's own gpudaemon_poll_duration_seconds, CPU time
    from gpudaemon_poll_cpu_seconds_total."""
    from gpudaemon.agent.quarantine import Quarantine

    backend = SimulatedBackend(parse_profile(profile(n, measured=True)), seed=1)
    cache = Cache()
    poller = Poller(backend, cache)
    quarantine = Quarantine(
        poll=lambda: None,
        reconcile=lambda: None,
        unhealthy=lambda: frozenset(s.uuid for s in cache.get().samples if not s.healthy),
    )
    quarantine.published(frozenset())  # as after the agent's first reconcile

    def telemetry() -> None:  # app.py's Agent._telemetry
        poller.telemetry()
        quarantine.after_poll()

    reg = CollectorRegistry()
    runner = JobRunner({"telemetry": Job("telemetry", "* * * * * *", telemetry)}, AgentMetrics(reg))
    poller.inventory()

    def totals() -> tuple[float, float, float]:
        labels = {"task": "telemetry"}
        wall = reg.get_sample_value("gpudaemon_poll_duration_seconds_sum", labels) or 0.0
        count = reg.get_sample_value("gpudaemon_poll_duration_seconds_count", labels) or 0.0
        cpu = reg.get_sample_value("gpudaemon_poll_cpu_seconds_total", labels) or 0.0
        return wall, cpu, count

    for _ in range(20):
        runner.run("telemetry")
    out: dict[str, float] = {}
    for mode, pause in (("loop", 0.0), ("idle", cadence_s)):
        w0, c0, k0 = totals()
        for _ in range(cycles):
            if pause:
                time.sleep(pause)
            runner.run("telemetry")
        w1, c1, k1 = totals()
        out[f"{mode}_wall"] = (w1 - w0) / (k1 - k0) * 1000 / n
        out[f"{mode}_cpu"] = (c1 - c0) / (k1 - k0) * 1000 / n
    return out


def real_gpu_rows(cycles: int) -> list[str]:
    try:
        from gpudaemon.backends.nvml import NvmlBackend

        b = NvmlBackend(xid_events=False)
        inv = b.inventory()
    except Exception as e:
        return [f"real NVML: not measured ({e.__class__.__name__}: no usable NVIDIA GPU here)"]
    n = len(inv.gpus)
    for _ in range(5):
        b.sample()
    t, e = [], []
    for _ in range(cycles):
        t0 = time.perf_counter()
        b.sample()
        t.append(time.perf_counter() - t0)
    for _ in range(min(cycles, 50)):
        t0 = time.perf_counter()
        b.energy()
        e.append(time.perf_counter() - t0)
    b.close()
    rows = [
        f"real NVML full telemetry sample: {statistics.median(t) * 1000 / n:.3f} ms per GPU "
        f"(target <= {SAMPLE_TARGET_MS}; {n} GPUs, {inv.gpus[0].name}, driver "
        f"{inv.driver_version})",
        f"real NVML energy read (schedules.energy): {statistics.median(e) * 1000 / n:.3f} ms "
        "per GPU",
    ]
    smi = shutil.which("nvidia-smi")
    if smi:
        s = []
        for _ in range(min(cycles, 20)):
            t0 = time.perf_counter()
            subprocess.run(
                [smi, f"--query-gpu={SMI_FIELDS}", "--format=csv"], capture_output=True, check=True
            )
            s.append(time.perf_counter() - t0)
        rows.append(
            f"nvidia-smi --query-gpu (what nvidia_gpu_exporter/Telegraf run): "
            f"{statistics.median(s) * 1000 / n:.3f} ms per GPU"
        )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=300)
    ap.add_argument(
        "--idle-polls", type=int, default=10,
        help="polls of the whole job at the default cadence (1 s apart) per size",
    )  # fmt: skip
    args = ap.parse_args()
    print(
        f"bench/poll  {datetime.now(UTC):%Y-%m-%d}  {platform.node()}  "
        f"python {platform.python_version()}  cycles={args.cycles}  (medians, ms per GPU per cycle)"
    )
    print()
    rows = []
    for n in (1, 8, 64):
        cycles = args.cycles if n < 64 else max(50, args.cycles // 4)
        r = measure(n, cycles)
        m = measure_measured(n, max(20, cycles // 3))
        rows.append(
            (
                n,
                f"{r['backend']:.4f}",
                f"{r['poll']:.4f}",
                f"{r['labels']:.4f}",
                f"{r['total']:.4f}",
                "ok" if r["total"] <= TARGET_MS else "OVER",
                f"{m['sample']:.4f}",
                "ok" if m["sample"] <= SAMPLE_TARGET_MS else "OVER",
                f"{m['energy']:.3f}",
                f"{m['both']:.3f}",
            )
        )
    print_table(
        (
            "GPUs",
            "backend (free sim)",
            "poll overhead",
            "label build",
            "agent total",
            f"<= {TARGET_MS}",
            "full sample, h100-measured",
            f"<= {SAMPLE_TARGET_MS}",
            "energy read, h100-measured",
            "sample + energy (before)",
        ),
        rows,
    )
    print()
    print("agent total = poll overhead (job wrapper, cache, metrics) + label build, counted every")
    print("cycle although labels reconcile less often. backend (free sim) is time inside the")
    print("simulated backend, the stand-in for time inside NVML. h100-measured: the simulator")
    print("charges each NVML call its measured H100 mean; the full sample is NVML + agent for")
    print("one telemetry poll, the energy read runs on schedules.energy (default 30 s), and")
    print("'sample + energy' is what every poll cost while energy was part of the sample.")
    print("Scrape cost: see bench/scrape.")
    print()
    whole = []
    for n in (1, 8):
        w = measure_whole_job(n, args.idle_polls, 1.0)
        whole.append((
            n, f"{w['loop_wall']:.4f}", f"{w['loop_cpu']:.4f}", f"{w['idle_wall']:.4f}",
            f"{w['idle_cpu']:.4f}", "ok" if w["idle_wall"] <= SAMPLE_TARGET_MS else "OVER",
        ))  # fmt: skip
    print_table(
        ("GPUs", "whole job, loop: wall", "cpu", "whole job, 1 s apart: wall", "cpu",
         f"<= {SAMPLE_TARGET_MS}"),
        whole,
    )  # fmt: skip
    print("whole job: run_job('telemetry') as the agent wires it (h100-measured), timed by the")
    print("agent's own metrics: wall (gpudaemon_poll_duration_seconds) and CPU")
    print("(gpudaemon_poll_cpu_seconds_total), in a tight loop and 1 s apart with the process")
    print("idle in between, as the agent runs it.")
    for row in real_gpu_rows(args.cycles):
        print(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
