"""bench/memory: the whole agent's RSS, as the budget counts it (issue 19).

A real `gpudaemon run` process on simulated dgx-h100 GPUs, writing labels, the `gpus`
annotation and its Lease to a real kube-apiserver, history to a real influxd 1.8.10,
and /metrics scraped every second, with and without the kubelet's pod-resources
socket (a fake kubelet on a unix socket: with it the agent loads grpc). RSS and its
peak (VmHWM) come from /proc after `--seconds` of running. Then the same imports one
by one in a fresh interpreter, for the breakdown. Real NVML adds what `nvmlInit` took
on an H100 (22 MiB, ../shared/measurements/h100-nvml.md), shown as an allowance.

  scripts/bench memory [--seconds 30]
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.table import print_table
from tests.integration.influx.server import InfluxServer
from tests.integration.kube.controlplane import RBAC, ControlPlane
from tests.support import REPO, free_port, http_get, start_agent, stop, tools_bin, wait_for

NVML_INIT_MIB = 22.0  # measured on an H100 (nvmlInit alone)
BUDGET_SIM_MIB = 60.0
BUDGET_REAL_MIB = 80.0

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
    ("API client in a pod (no kubernetes import)", "gpudaemon.agent.nodelabels"),
    ("kubernetes (only with a kubeconfig)", "kubernetes"),
    ("history (urllib3 transport, SQLite spool)", "gpudaemon.history.writer"),
    ("pod-resources client (h2, protobuf)", "h2.connection, gpudaemon.podresources._gen.api_pb2"),
    ("pynvml (the module; nvmlInit is the allowance)", "pynvml"),
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


# A pod's view: the service account's token and CA where the wrapper says they are
# mounted, and the API server in the environment, as kubelet sets them.
IN_CLUSTER = (
    "import sys, pathlib, gpudaemon.incluster as ic\n"
    "ic.SA_DIR = pathlib.Path(sys.argv.pop(1)); ic.SA_TOKEN = ic.SA_DIR / 'token'\n"
    "from gpudaemon.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def run_agent(
    cp: ControlPlane,
    influx: InfluxServer,
    db: str,
    tmp: Path,
    seconds: float,
    socket: str,
    in_cluster: bool,
) -> tuple[float, float, int]:
    port = free_port()
    node = f"mem-{port}"
    cp.create_node(node)
    cfg = tmp / f"{node}.yaml"
    env: dict[str, str] = {}
    if in_cluster:
        sa = tmp / f"sa-{node}"
        sa.mkdir()
        (sa / "token").write_text("agent-token\n")
        (sa / "ca.crt").write_bytes(Path(cp.ca).read_bytes())
        host, _, api_port = cp.server.removeprefix("https://").rpartition(":")
        env = {"KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": api_port}
        kube = "{in_cluster: true}"
    else:
        kube = f"{{kubeconfig: '{cp.agent_kubeconfig}'}}"
    cfg.write_text(
        f"node_name: {node}\nsimulate: dgx-h100\n"
        f"metrics: {{listen: '127.0.0.1:{port}', pod_resources_socket: '{socket}'}}\n"
        "labels: {to: apiserver}\n"
        f"kubernetes: {kube}\n"
        f"influxdb: {{url: '{influx.url}', bucket: '{db}/autogen',"
        f" spool_dir: '{tmp / node}'}}\n"
        "schedules: {telemetry: '* * * * * *', history: '*/10 * * * * *'}\n"
    )
    args = ["run", "--config", str(cfg)]
    if in_cluster:
        proc = subprocess.Popen(
            [sys.executable, "-c", IN_CLUSTER, str(tmp / f"sa-{node}"), *args],
            env={**os.environ, **env},
            stdout=open(tmp / f"{node}.log", "wb"),  # noqa: SIM115 - the child's
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
    else:
        proc = start_agent(args, log=tmp / f"{node}.log")
    try:
        try:
            wait_for(
                lambda: http_get(f"http://127.0.0.1:{port}/readyz")[0] == 200, 60, what="/readyz"
            )
        except AssertionError:
            raise SystemExit((tmp / f"{node}.log").read_text()[-3000:]) from None
        series = 0
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            status, body = http_get(f"http://127.0.0.1:{port}/metrics")
            assert status == 200
            series = sum(1 for ln in body.splitlines() if ln.startswith(b"gpudaemon_gpu_"))
            time.sleep(1.0)
        labelled = cp.node(node)["metadata"].get("labels", {}).get("gpudaemon.io/gpu.count")
        assert labelled == "8", "the agent did not label its Node"
        assert influx.points(db, field="power_watts"), "the agent wrote no history"
        rss, peak = rss_mib(proc.pid)
    finally:
        stop(proc)
    return rss, peak, series


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    args = ap.parse_args()
    from tests.integration.podresources.fake_kubelet import KubeletServer

    tools = tools_bin("k8s", "etcd", "influxd")
    cp = ControlPlane(tools)
    with tempfile.TemporaryDirectory() as tmp_:
        tmp = Path(tmp_)
        (tmp / "influxd").mkdir()
        influx = InfluxServer(tools / "influxd", tmp / "influxd")
        kubelet = KubeletServer(tmp / "kubelet.sock")
        try:
            cp.start()
            cp.apply_manifest(RBAC)
            influx.start()
            db = influx.create_database("mem")
            absent, present = str(tmp / "absent.sock"), str(tmp / "kubelet.sock")
            runs = [
                ("kubeconfig, no kubelet socket", absent, False),
                ("in a pod (service account), no kubelet socket", absent, True),
                ("in a pod, kubelet socket (pod attribution on)", present, True),
            ]
            results = [
                (name, run_agent(cp, influx, db, tmp, args.seconds, sock, pod))
                for name, sock, pod in runs
            ]
        finally:
            kubelet.stop()
            influx.stop()
            cp.stop()
    steps = import_steps()
    rows = []
    for name, (rss, peak, series) in results:
        real = rss + NVML_INIT_MIB
        rows.append(
            (
                name,
                f"{rss:.1f}",
                f"{peak:.1f}",
                "ok" if rss <= BUDGET_SIM_MIB else "OVER",
                f"{real:.1f}",
                "ok" if real <= BUDGET_REAL_MIB else "OVER",
                series,
            )
        )
    print_table(
        (
            "agent (simulated dgx-h100, labels + Lease to kube-apiserver, InfluxDB on, "
            "/metrics scraped 1/s)",
            "RSS MiB",
            "peak MiB",
            f"<= {BUDGET_SIM_MIB:g}",
            f"+ nvmlInit {NVML_INIT_MIB:g} MiB",
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
    for what, v in steps:
        breakdown.append((what, f"{v:.1f}", f"+{v - prev:.1f}" if prev else ""))
        prev = v
    print_table(("import step (fresh interpreter)", "RSS MiB", "added"), breakdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
