"""Safe to run in production (issue 17), on a real etcd, kube-apiserver and
kube-scheduler, with `gpudaemon extender` and `gpudaemon run` as real processes the way
the chart runs them (the extender on 127.0.0.1 beside the scheduler):

1. a flood of /filter requests with invented pod UIDs from another process changes
   nothing: real GPU pods bind, packed as without the flood, and the extender's RSS
   stays within 20% of idle; in Service mode a caller without the client certificate
   is refused while kube-scheduler, with its tlsConfig, places pods;
2. a node whose agent starts, or restarts after its Lease lapsed, gets a GPU pod within
   10 s of the agent's start;
3. an XID 79 survives killing and restarting the agent on the same simulated GPUs, and
   a new boot ID clears it.
"""

from __future__ import annotations

import json
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpudaemon.kube.lease import lease_expiry
from gpudaemon.labels.annotations import decode_gpus
from tests.certs import Pki, make_pki
from tests.integration.kube.controlplane import ADMISSION, RBAC, ControlPlane
from tests.integration.scheduler.rig import SchedulerRig
from tests.support import free_port, http_get, scrape, start_agent, stop, wait_for

pytestmark = pytest.mark.integration

P = "gpudaemon.io/"
SCHED = "gpudaemon-scheduler"
TLS_SCHED = "gpudaemon-scheduler-tls"


class Proc:
    def __init__(self, proc: subprocess.Popen[bytes], log: Path, ports: dict[str, int]) -> None:
        self.proc, self.log, self.ports = proc, log, ports

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")

    def metric(self, name: str, **labels: str) -> float:
        return scrape(f"http://127.0.0.1:{self.ports['metrics']}/metrics", name, **labels)


def start_extender(
    rig: SchedulerRig, name: str, scheduler: str, tls: dict[str, str] | None = None
) -> Proc:
    port, metrics = free_port(), free_port()
    ext: dict[str, Any] = {
        "listen": f"{'0.0.0.0' if tls else '127.0.0.1'}:{port}",  # as the chart renders it
        "metrics_listen": f"127.0.0.1:{metrics}",
        "policy": "binpack",
        "scheduler_name": scheduler,
    }
    if tls:
        ext["tls"] = tls
    cfg = rig.dir / f"{name}.yaml"
    cfg.write_text(yaml.safe_dump({
        "extender": ext,
        "kubernetes": {"kubeconfig": str(rig.cp.admin_kubeconfig), "lease_namespace": "gpudaemon"},
    }))  # fmt: skip
    log = rig.dir / f"{name}.log"
    proc = start_agent(["extender", "--config", str(cfg)], log=log)
    out = Proc(proc, log, {"port": port, "metrics": metrics})
    rig.procs.append(proc)
    wait_for(
        lambda: http_get(f"http://127.0.0.1:{metrics}/readyz")[0] == 200,
        timeout=60,
        what=f"{name} /readyz",
    )
    return out


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def safety(tools_bin: Path, pki: Pki) -> Iterator[tuple[SchedulerRig, Proc, Proc]]:
    cp = ControlPlane(tools_bin)
    rig = SchedulerRig(cp)
    try:
        cp.start()
        cp.apply_manifest(RBAC)
        cp.apply_manifest(ADMISSION)
        ext = start_extender(rig, "extender", SCHED)
        rig.start_scheduler(SCHED, True, url=f"http://127.0.0.1:{ext.ports['port']}")
        tls_ext = start_extender(
            rig,
            "extender-tls",
            TLS_SCHED,
            tls={"cert_file": pki.server.cert, "key_file": pki.server.key,
                 "client_ca_file": pki.ca},
        )  # fmt: skip
        rig.start_scheduler(
            TLS_SCHED,
            True,
            url=f"https://127.0.0.1:{tls_ext.ports['port']}",
            tls={"certFile": pki.client.cert, "keyFile": pki.client.key, "caFile": pki.ca},
        )
        yield rig, ext, tls_ext
    finally:
        rig.stop()
        cp.stop()


FLOOD = r"""
import http.client, json, sys, threading, time, uuid, random
port, rate, seconds, nodes = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), json.loads(sys.argv[4])
codes, errors, lock = {}, [0], threading.Lock()
threads = 8
def body():
    g = random.randint(1, 8)
    return json.dumps({"Pod": {"metadata": {"uid": str(uuid.uuid4()), "namespace": "default",
        "name": "fake-" + uuid.uuid4().hex[:8]}, "spec": {"schedulerName": "gpudaemon-scheduler",
        "containers": [{"name": "c", "resources": {"requests": {"nvidia.com/gpu": str(g)}}}]}},
        "NodeNames": nodes}).encode()
def run(k):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    interval, start, n = threads / rate, time.monotonic(), 0
    while time.monotonic() - start < seconds:
        target = start + n * interval + k * interval / threads
        if (d := target - time.monotonic()) > 0:
            time.sleep(d)  # paced to the rate
        n += 1
        try:
            conn.request("POST", "/filter", body=body(), headers={"Content-Type": "application/json"})
            r = conn.getresponse(); r.read()
            with lock: codes[r.status] = codes.get(r.status, 0) + 1
        except Exception:
            with lock: errors[0] += 1
            conn.close(); conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
ts = [threading.Thread(target=run, args=(k,)) for k in range(threads)]
[t.start() for t in ts]; [t.join() for t in ts]
print(json.dumps({"codes": codes, "errors": errors[0]}))
"""


def place(rig: SchedulerRig, group: str, nodes: list[str], pods: int) -> dict[str, int]:
    """`pods` 2-GPU pods for our scheduler, one at a time; GPUs used per node."""
    for _ in range(pods):
        rig.wait_bound(rig.create_pod(2, group), timeout=60)
    return rig.gpus_by_node(nodes)


def test_a_flood_of_invented_pods_books_nothing(
    safety: tuple[SchedulerRig, Proc, Proc],
) -> None:
    rig, ext, _ = safety
    quiet, flooded = (uuid.uuid4().hex[:6] for _ in range(2))
    nodes = {g: [f"{g}-{i}" for i in range(4)] for g in (quiet, flooded)}
    for g, names in nodes.items():
        for n in names:
            rig.add_node(n, g)
    rig.run_agents([n for names in nodes.values() for n in names])
    wait_for(
        lambda: ext.metric("gpudaemon_extender_cache_objects", kind="leases") >= 8,
        timeout=30,
        what="the extender to see the Leases",
    )
    without = place(rig, quiet, nodes[quiet], 8)  # also warms the extender up
    wait_for(
        lambda: ext.metric("gpudaemon_extender_cache_objects", kind="assumed") == 0,
        timeout=30,
        what="the extender idle: every binding seen, no pod assumed",
    )
    idle_kib = ext.rss_kib()
    assumed_before = ext.metric("gpudaemon_extender_assumed_pods_total")

    flood = subprocess.Popen(
        [sys.executable, "-c", FLOOD, str(ext.ports["port"]), "200", "30",
         json.dumps(nodes[flooded] + nodes[quiet])],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    peak_kib = idle_kib
    filtered = ext.metric("gpudaemon_extender_requests_total", verb="filter")
    wait_for(
        lambda: ext.metric("gpudaemon_extender_requests_total", verb="filter") >= filtered + 200,
        timeout=30,
        what="the flood on",
    )
    created = 0
    started = time.monotonic()
    with_flood: dict[str, int] = {}
    while flood.poll() is None:
        if created < 8:
            rig.wait_bound(rig.create_pod(2, flooded), timeout=60)
            created += 1
            if created == 8:
                with_flood = rig.gpus_by_node(nodes[flooded])
        peak_kib = max(peak_kib, ext.rss_kib())
        assert ext.metric("gpudaemon_extender_cache_objects", kind="assumed") <= 1
        time.sleep(0.2)  # RSS and the assumed pods sampled over the flood's 30 s
    out, _err = flood.communicate()
    result = json.loads(out)
    assert created == 8, (
        f"only {created} pods bound during the flood ({time.monotonic() - started:.0f}s)"
    )
    sent = sum(result["codes"].values())
    assert sent >= 0.8 * 200 * 30 and result["errors"] == 0, result
    assert set(result["codes"]) == {"200"}, result  # answered (filtered), never crashed
    # Packed exactly as without the flood, with no overcommit.
    assert sorted(with_flood.values()) == sorted(without.values()) == [0, 0, 8, 8]
    # Real pods were verified and booked; no flood pod ever was (at most two bookings
    # per real pod: filter, then a retry). On a loaded machine a real pod's watch event
    # can come after the scheduler's call while the flood holds the lookup budget: that
    # pod is answered but not booked (by design: the flood must not become API load),
    # so one or two such misses are allowed; packing is checked exactly above.
    assumed = ext.metric("gpudaemon_extender_assumed_pods_total") - assumed_before
    assert 6 <= assumed <= 16, assumed
    unverified = ext.metric("gpudaemon_extender_unverified_pods_total")
    assert unverified >= 0.95 * sent
    assert ext.metric("gpudaemon_extender_unverified_pods_total", reason="rate_limited") > 0
    assert peak_kib <= 1.2 * idle_kib, (idle_kib, peak_kib)
    print(
        f"\nflood: {sent} requests in 30 s, extender RSS idle {idle_kib} KiB, peak {peak_kib} KiB"
    )


def test_a_burst_of_created_and_deleted_pods_leaves_no_assumption(
    safety: tuple[SchedulerRig, Proc, Proc],
) -> None:
    """A tenant creates 200 8-GPU pods for our scheduler and deletes each at once: the
    extender assumes the pods it ranks (counted on their node until their binding
    shows), and a pod deleted before its binding is never bound. Its assumption must go
    with it: the assumed GPUs are back to zero within 5 s of the burst, and a real pod
    binds, instead of every node looking full until the assumptions time out."""
    rig, ext, _ = safety
    group = uuid.uuid4().hex[:6]
    nodes = [f"{group}-{i}" for i in range(4)]
    for n in nodes:
        rig.add_node(n, group)
    rig.run_agents(nodes)
    wait_for(lambda: ext.metric("gpudaemon_extender_cache_objects", kind="leases") >= 4,
             timeout=30, what="the extender to see the Leases")  # fmt: skip
    before = ext.metric("gpudaemon_extender_assumed_pods_total")
    for _ in range(200):
        rig.delete_pods([rig.create_pod(8, group)])
    burst_end = time.monotonic()
    assumed = ext.metric("gpudaemon_extender_assumed_pods_total") - before
    wait_for(lambda: ext.metric("gpudaemon_extender_cache_objects", kind="assumed") == 0,
             timeout=5, interval=0.1, what="no assumed pod left 5 s after the burst")  # fmt: skip
    gone = time.monotonic() - burst_end
    node = rig.wait_bound(rig.create_pod(8, group), timeout=10)
    assert node in nodes
    assert assumed >= 1, "no pod of the burst was assumed: the test would prove nothing"
    print(
        f"\nburst: {assumed:.0f} of 200 created-and-deleted pods assumed; none left "
        f"{gone:.1f} s after the burst; a real 8-GPU pod then bound on {node}"
    )


def test_service_mode_requires_the_client_certificate(
    safety: tuple[SchedulerRig, Proc, Proc], pki: Pki
) -> None:
    rig, _, tls_ext = safety
    group = uuid.uuid4().hex[:6]
    names = [f"{group}-{i}" for i in range(2)]
    for n in names:
        rig.add_node(n, group)
    rig.run_agents(names)
    before = tls_ext.metric("gpudaemon_extender_requests_total", verb="filter", code="200")
    pod = rig.create_pod(2, group, scheduler=TLS_SCHED)
    assert rig.wait_bound(pod, timeout=60) in names
    # kube-scheduler called it over mutual TLS.
    assert tls_ext.metric("gpudaemon_extender_requests_total", verb="filter", code="200") > before
    url = f"https://127.0.0.1:{tls_ext.ports['port']}/filter"
    body = json.dumps({"Pod": {"metadata": {"uid": "x"}}, "NodeNames": names}).encode()
    for who, cert in (("no certificate", None), ("a stranger", pki.stranger)):
        ctx = ssl.create_default_context(cafile=pki.ca)
        if cert is not None:
            ctx.load_cert_chain(cert.cert, cert.key)
        with pytest.raises((ssl.SSLError, ConnectionError, urllib.error.URLError)):
            req = urllib.request.Request(url, data=body, method="POST")
            urllib.request.urlopen(req, context=ctx, timeout=5).read()
        print(f"{who}: refused")


def agent(
    rig: SchedulerRig, node: str, profile: Path, lease_s: int = 360
) -> subprocess.Popen[bytes]:
    cfg = rig.dir / f"agent-{node}.yaml"
    cfg.write_text(yaml.safe_dump({
        "node_name": node,
        "simulate": str(profile),
        "labels": {"to": "apiserver"},
        "metrics": {"listen": f"127.0.0.1:{free_port()}"},
        "kubernetes": {"kubeconfig": str(rig.cp.agent_kubeconfig),
                       "lease_namespace": "gpudaemon", "lease_duration_seconds": lease_s},
    }))  # fmt: skip
    return start_agent(["run", "--config", str(cfg)], log=rig.dir / f"agent-{node}.log")


def write_profile(path: Path, *, xid: bool = False, boot: str = "boot-1") -> Path:
    path.write_text(yaml.safe_dump({
        "boot_id": boot,
        "gpus": [{"name": "NVIDIA H100 80GB HBM3", "memory_total_mib": 81559,
                  "compute_capability": "9.0", "count": 8}],
        "faults": [{"kind": "xid", "gpu": 1, "xid": 79}] if xid else [],
    }))  # fmt: skip
    return path


def test_a_node_is_schedulable_within_10_s_of_its_agent_starting_or_restarting(
    safety: tuple[SchedulerRig, Proc, Proc],
) -> None:
    rig, _ext, _ = safety
    group = uuid.uuid4().hex[:6]
    node = f"{group}-new"
    rig.add_node(node, group)
    profile = write_profile(rig.dir / f"{node}.yaml")
    t0 = time.monotonic()
    proc = agent(rig, node, profile, lease_s=10)
    try:
        pod = rig.create_pod(2, group)
        rig.wait_bound(pod, timeout=30)
        first = time.monotonic() - t0
        # Restart after the Lease lapsed: the node is stale and turns pods away ...
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        lease = rig.cp.lease(node)
        assert lease is not None
        expiry = lease_expiry(lease)
        assert expiry is not None
        time.sleep(max(0.0, expiry.timestamp() - time.time()) + 1)  # past the Lease's expiry
        pod2 = rig.create_pod(2, group)
        wait_for(
            lambda: "stale" in " ".join(rig.events_for(pod2)),
            timeout=40,
            interval=0.5,
            what="the extender to turn a pod away as stale",
        )
        # ... until the agent is back.
        t1 = time.monotonic()
        proc = agent(rig, node, profile, lease_s=10)
        rig.wait_bound(pod2, timeout=30)
        second = time.monotonic() - t1
    finally:
        stop(proc)
    print(f"\nnew node: pod bound {first:.1f} s after the agent started; "
          f"after a restart: {second:.1f} s")  # fmt: skip
    assert first <= 10 and second <= 10, (first, second)


def test_an_xid_survives_an_agent_restart_until_the_node_reboots(
    safety: tuple[SchedulerRig, Proc, Proc],
) -> None:
    rig, _, _ = safety
    group = uuid.uuid4().hex[:6]
    node = f"{group}-xid"
    rig.add_node(node, group)
    profile = write_profile(rig.dir / f"{node}.yaml", xid=True)

    def state() -> tuple[str, str, bool]:
        n = rig.cp.node(node)
        labels = n["metadata"].get("labels") or {}
        conds = [
            c for c in n.get("status", {}).get("conditions") or [] if c["type"] == "GPUHealthy"
        ]
        gpus = decode_gpus(n["metadata"].get("annotations", {}).get(P + "gpus", "[]"))
        gpu1 = [g for g in gpus if g.index == 1]
        return (
            labels.get(P + "gpu.unhealthy", ""),
            f"{conds[0]['status']}: {conds[0]['message']}" if conds else "",
            bool(gpu1) and not gpu1[0].healthy,
        )

    def holder() -> str:
        lease = rig.cp.lease(node) or {}
        return str(lease.get("spec", {}).get("holderIdentity", ""))

    proc = agent(rig, node, profile)
    try:
        wait_for(lambda: state()[0] == "1", timeout=30, what="the XID on the Node")
        proc.send_signal(signal.SIGKILL)  # no shutdown of any kind
        proc.wait()
        old_holder = holder()
        write_profile(profile, xid=False)  # the same GPUs, reporting no fault now
        proc = agent(rig, node, profile)
        wait_for(lambda: holder() not in ("", old_holder), timeout=30, what="the new agent's Lease")
        # A negative check: a few polls of the healthy-reporting GPU forget nothing.
        time.sleep(2)
        unhealthy, condition, gpu1_sick = state()
        assert unhealthy == "1" and gpu1_sick
        assert condition.startswith("False: ") and "GPU 1: xid 79" in condition
        # A GPU pod cannot land there (the extender avoids nodes with a sick GPU).
        stop(proc)
        write_profile(profile, xid=False, boot="boot-2")  # the node rebooted
        proc = agent(rig, node, profile)
        wait_for(
            lambda: (s := state())[0] == "0" and s[1].startswith("True: ") and not s[2],
            timeout=30,
            what="the reset to clear the fault (label, condition, annotation)",
        )
        assert P + "gpu-faults" not in rig.cp.node(node)["metadata"].get("annotations", {})
    finally:
        stop(proc)
