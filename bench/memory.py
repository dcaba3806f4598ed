"""bench/memory: the whole agent's RSS, as the budget counts it (issues 19 and 29).

A real `gpudaemon run` process on simulated `h100-measured` GPUs (8 H100s whose NVML
calls take what they took on the real one), writing labels, the `gpus` annotation and
its Lease to a real kube-apiserver, history to a real influxd 1.8.10, and /metrics
scraped every second: with a kubeconfig, and as in a pod (a service account's token and
CA, the API server in the environment) without and with the kubelet's pod-resources
socket (a fake kubelet on a unix socket). RSS and its peak (VmHWM) come from /proc after
`--seconds` of running. Real NVML adds what it added on an H100 (`NVML_INIT_MIB`, below),
shown as an allowance.

`--unreachable` needs no server: the agent as it was measured on a real H100 (a
kubeconfig and InfluxDB on, both unreachable), on simulated GPUs, and with `--nvml` on
the real ones beside it: on a lent GPU the next measurement is this one command.

`--before REV` runs the same agents from the gpudaemon package at an earlier commit
beside this tree's, in the same run (same servers, same machine load), for a
before/after. Then this tree's imports one by one in a fresh interpreter, for the
breakdown.

  scripts/bench memory [--seconds 30] [--before REV]
  scripts/bench memory --unreachable [--nvml] [--seconds 60] [--before REV]
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from bench.table import print_table
from tests.integration.influx.server import InfluxServer
from tests.integration.kube.controlplane import RBAC, ControlPlane
from tests.support import (
    REPO,
    free_port,
    http_get,
    service_account_dir,
    start_agent,
    start_agent_in_pod,
    stop,
    tools_bin,
    wait_for,
)

# What real NVML adds to the agent's RSS over simulated GPUs: the pynvml module, nvmlInit
# (the driver library and its buffers) and the driver's memory while polling. Derived
# from one agent configuration (`--unreachable`: a kubeconfig and InfluxDB on, both
# unreachable, telemetry every second, /metrics scraped) at one commit (9831538) with
# one GPU: 107.5 MiB on a real H100 (Python 3.12.3, 2026-11-26,
# ../shared/measurements/h100-gpm-health.md) against 70.5 MiB on one simulated H100
# (Python 3.12.1 and 3.11.7 alike, docs/benchmarks.md): 37.0 MiB. The earlier 22 MiB
# was nvmlInit alone, in a fresh interpreter.
NVML_INIT_MIB = 37.0
BUDGET_REAL_MIB = 100.0  # the agent with real NVML (issue 29)
BUDGET_SIM_MIB = BUDGET_REAL_MIB - NVML_INIT_MIB

# What the agent imports, in the order it needs them; each row's figure is the RSS after
# that import in one fresh interpreter.
IMPORT_STEPS = (
    ("Python", ""),
    ("loguru (asyncio, ssl)", "loguru"),
    ("pydantic, pydantic-settings, yaml", "pydantic_settings, yaml"),
    ("apscheduler, prometheus-client", "apscheduler, prometheus_client"),
    ("gpudaemon.config (the settings models)", "gpudaemon.config"),
    (
        "gpudaemon.agent.app, gpudaemon.cli (wiring, HTTP server)",
        "gpudaemon.agent.app, gpudaemon.cli",
    ),
    ("our API client and label sink (no kubernetes yet)", "gpudaemon.agent.nodelabels"),
    ("urllib3, dateutil (under both official clients)", "urllib3, dateutil.parser"),
    ("requests, oauthlib (kubernetes' kubeconfig loader)", "requests, requests_oauthlib"),
    ("kubernetes (ApiClient, config; models are lazy)", "kubernetes"),
    ("influxdb-client (generated API, reactivex)", "influxdb_client"),
    ("history (writer, SQLite spool)", "gpudaemon.history.writer"),
    ("pod-resources client (h2, protobuf)", "h2.connection, gpudaemon.podresources._gen.api_pb2"),
    ("pynvml (the module; in the real-NVML allowance)", "pynvml"),
)

RUNS = (  # (name, kubelet socket present, in a pod, InfluxDB on)
    ("kubeconfig, no kubelet socket", False, False, True),
    ("in a pod (service account), no kubelet socket", False, True, True),
    ("in a pod, kubelet socket (the chart's default)", True, True, True),
    ("in a pod, kubelet socket, history off", True, True, False),
)


def rss_mib(pid: int) -> tuple[float, float]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def import_steps() -> list[tuple[str, float]]:
    code = (
        "import importlib, sys\n"
        "def rss():\n"
        "    for l in open('/proc/self/status'):\n"
        "        if l.startswith('VmRSS'): return int(l.split()[1]) / 1024\n"
        "for mods in sys.argv[1:]:\n"
        "    for m in filter(None, (x.strip() for x in mods.split(','))):\n"
        "        importlib.import_module(m)\n"
        "    print(rss())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, *(m for _, m in IMPORT_STEPS)],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    ).stdout.split()
    return [(what, float(v)) for (what, _), v in zip(IMPORT_STEPS, out, strict=True)]


def scrape_for(port: int, seconds: float, log: Path) -> int:
    """Once the agent is ready, scrape its /metrics every second for `seconds`, as
    Prometheus would; how many GPU series the last page had."""
    try:
        wait_for(lambda: http_get(f"http://127.0.0.1:{port}/readyz")[0] == 200, 60, what="/readyz")
    except AssertionError:
        raise SystemExit(log.read_text()[-3000:]) from None
    series = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        status, body = http_get(f"http://127.0.0.1:{port}/metrics")
        assert status == 200
        series = sum(1 for ln in body.splitlines() if ln.startswith(b"gpudaemon_gpu_"))
        time.sleep(1.0)
    return series


def run_agent(
    cp: ControlPlane,
    influx: InfluxServer,
    db: str,
    tmp: Path,
    seconds: float,
    socket: str,
    in_cluster: bool,
    code: Path,
    history: bool = True,
) -> tuple[float, float, int]:
    """One agent from the gpudaemon package under `code`: its RSS and peak after
    `seconds`, and how many GPU series its /metrics had."""
    port = free_port()
    node = f"mem-{port}"
    cp.create_node(node)
    cfg = tmp / f"{node}.yaml"
    kube = "" if in_cluster else f"kubernetes: {{kubeconfig: '{cp.agent_kubeconfig}'}}\n"
    influxdb = (
        f"influxdb: {{url: '{influx.url}', bucket: '{db}/autogen', spool_dir: '{tmp / node}'}}\n"
        if history
        else ""
    )
    cfg.write_text(
        f"node_name: {node}\nsimulate: h100-measured\n"
        f"metrics: {{listen: '127.0.0.1:{port}', pod_resources_socket: '{socket}'}}\n"
        "labels: {to: apiserver}\n"
        f"{kube}{influxdb}"
        "schedules: {telemetry: '* * * * * *', history: '*/10 * * * * *'}\n"
    )
    args = ["run", "--config", str(cfg)]
    log = tmp / f"{node}.log"
    if in_cluster:
        sa = service_account_dir(tmp / f"sa-{node}", "agent-token\n", Path(cp.ca))
        proc = start_agent_in_pod(args, sa, cp.server, log=log, cwd=code)
    else:
        proc = start_agent(args, log=log, cwd=code)
    try:
        series = scrape_for(port, seconds, log)
        labelled = cp.node(node)["metadata"].get("labels", {}).get("gpudaemon.io/gpu.count")
        assert labelled == "8", "the agent did not label its Node"
        assert not history or influx.points(db, field="power_watts"), "no history written"
        rss, peak = rss_mib(proc.pid)
    finally:
        stop(proc)
    return rss, peak, series


def run_unreachable(tmp: Path, seconds: float, nvml: bool, code: Path) -> tuple[float, float]:
    """The agent as it was measured on a real H100: a kubeconfig and InfluxDB on, both
    servers unreachable (labels back off, history spools), telemetry every second,
    /metrics scraped every second. Needs no server and no network: one command on a
    lent GPU (`nvml`: real NVML instead of simulated h100-measured GPUs)."""
    port = free_port()
    kubeconfig = tmp / f"unreachable-{port}.kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\n"
        "clusters: [{name: c, cluster: {server: 'https://127.0.0.1:9'}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: x, context: {cluster: c, user: u}}]\ncurrent-context: x\n"
    )
    token = tmp / f"influx-{port}.token"
    token.write_text("t\n")
    cfg = tmp / f"unreachable-{port}.yaml"
    cfg.write_text(
        f"node_name: mem-{port}\n"
        + ("" if nvml else "simulate: h100-measured\n")
        + f"metrics: {{listen: '127.0.0.1:{port}'}}\n"
        "labels: {to: apiserver}\n"
        f"kubernetes: {{kubeconfig: '{kubeconfig}'}}\n"
        f"influxdb: {{url: 'http://127.0.0.1:9', org: o, bucket: b, token_file: '{token}',"
        f" spool_dir: '{tmp / f'spool-{port}'}'}}\n"
        "schedules: {telemetry: '* * * * * *', history: '*/10 * * * * *'}\n"
    )
    log = tmp / f"unreachable-{port}.log"
    proc = start_agent(["run", "--config", str(cfg)], log=log, cwd=code)
    try:
        scrape_for(port, seconds, log)
        return rss_mib(proc.pid)
    finally:
        stop(proc)


def unreachable_main(seconds: float, before: str | None, nvml: bool) -> int:
    rows = []
    with tempfile.TemporaryDirectory() as tmp_:
        tmp = Path(tmp_)
        codes = [("this tree", REPO)]
        if before:
            codes.insert(0, (before, checkout(before, tmp / "before")))
        for which, code in codes:
            for real in (False, True) if nvml else (False,):
                rss, peak = run_unreachable(tmp, seconds, real, code)
                whole = rss if real else rss + NVML_INIT_MIB
                rows.append((
                    "real NVML" if real else "simulated h100-measured", which,
                    f"{rss:.1f}", f"{peak:.1f}",
                    f"{whole:.1f}" + ("" if real else f" (+{NVML_INIT_MIB:g})"),
                    "ok" if whole <= BUDGET_REAL_MIB else "OVER",
                ))  # fmt: skip
    print_table(
        ("agent (kubeconfig + InfluxDB on, both unreachable; telemetry 1/s; /metrics 1/s)",
         "code", "RSS MiB", "peak MiB", "with real NVML", f"<= {BUDGET_REAL_MIB:g}"),
        rows,
        title=(
            f"bench/memory --unreachable  {time.strftime('%Y-%m-%d')}  {platform.node()}  "
            f"{os.cpu_count()} cpu  python {platform.python_version()}  {seconds:g} s each"
        ),
    )  # fmt: skip
    return 0


def checkout(rev: str, into: Path) -> Path:
    """The gpudaemon package as it was at `rev`, to run beside this tree's."""
    tar = subprocess.run(
        ["git", "archive", rev, "gpudaemon"], cwd=REPO, capture_output=True, check=True
    ).stdout
    into.mkdir()
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        t.extractall(into, filter="data")
    return into


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--before", metavar="REV", help="also run the agent as of this commit")
    ap.add_argument(
        "--unreachable", action="store_true",
        help="no servers: the agent with a kubeconfig and InfluxDB on, both unreachable "
        "(as measured on a real H100); runs anywhere, a lent GPU included",
    )  # fmt: skip
    ap.add_argument(
        "--nvml", action="store_true",
        help="with --unreachable: also run the agent on the real GPUs (NVML) beside the "
        "simulated one",
    )  # fmt: skip
    args = ap.parse_args()
    if args.unreachable:
        return unreachable_main(args.seconds, args.before, args.nvml)
    if args.nvml:
        ap.error("--nvml needs --unreachable")
    from tests.integration.podresources.fake_kubelet import KubeletServer

    tools = tools_bin("k8s", "etcd", "influxd")
    cp = ControlPlane(tools)
    results: dict[tuple[str, str], tuple[float, float, int]] = {}
    with tempfile.TemporaryDirectory() as tmp_:
        tmp = Path(tmp_)
        codes = [("this tree", REPO)]
        if args.before:
            codes.insert(0, (args.before, checkout(args.before, tmp / "before")))
        (tmp / "influxd").mkdir()
        influx = InfluxServer(tools / "influxd", tmp / "influxd")
        kubelet = KubeletServer(tmp / "kubelet.sock")
        try:
            cp.start()
            cp.apply_manifest(RBAC)
            influx.start()
            db = influx.create_database("mem")
            sockets = {False: str(tmp / "absent.sock"), True: str(tmp / "kubelet.sock")}
            for name, socket, pod, history in RUNS:  # before and after, side by side
                for which, code in codes:
                    results[(name, which)] = run_agent(
                        cp, influx, db, tmp, args.seconds, sockets[socket], pod, code, history
                    )
        finally:
            kubelet.stop()
            influx.stop()
            cp.stop()
    rows = []
    for (name, which), (rss, peak, series) in results.items():
        real = rss + NVML_INIT_MIB
        rows.append(
            (
                name,
                which,
                f"{rss:.1f}",
                f"{peak:.1f}",
                f"{real:.1f}",
                "ok" if real <= BUDGET_REAL_MIB else "OVER",
                series,
            )
        )
    print_table(
        (
            "agent (h100-measured, labels + Lease to kube-apiserver, InfluxDB on unless "
            "said, /metrics scraped 1/s)",
            "code",
            "RSS MiB",
            "peak MiB",
            f"+ real NVML {NVML_INIT_MIB:g} MiB",
            f"<= {BUDGET_REAL_MIB:g}",
            "GPU series",
        ),
        rows,
        title=(
            f"bench/memory  {time.strftime('%Y-%m-%d')}  {platform.node()}  "
            f"{os.cpu_count()} cpu  python {platform.python_version()}  {args.seconds:g} s each"
        ),
    )
    prev = 0.0
    breakdown = []
    for what, v in import_steps():
        breakdown.append((what, f"{v:.1f}", f"+{v - prev:.1f}" if prev else ""))
        prev = v
    print_table(("import step (fresh interpreter, this tree)", "RSS MiB", "added"), breakdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
