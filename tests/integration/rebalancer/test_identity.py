"""Leader identities are unique (issue 28): two `gpudaemon rebalance` processes on one host
with no $POD_NAME and no `--identity` (the case where both led and evicted 4 pods in half
a second under a cap of 3 a minute) elect one leader against a real kube-apiserver, each
under `<hostname>_<UUID>`; when the leader is killed (-9, no release), the other takes
over once the Lease runs out (a restarted process, with a new suffix, would the same:
the state it carries on from is on the Lease, not tied to the identity)."""

from __future__ import annotations

import contextlib
import re
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from gpudaemon.errors import KubeError
from tests.integration.kube.conftest import control_plane as control_plane
from tests.integration.kube.controlplane import ControlPlane
from tests.support import free_port, http_get, scrape, start_agent, stop, wait_for

pytestmark = pytest.mark.integration

LEASE = "/apis/coordination.k8s.io/v1/namespaces/gpudaemon/leases/gpudaemon-rebalancer"
UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
DURATION = 6


def leader(url: str) -> float:
    try:
        return scrape(url + "/metrics", "gpudaemon_rebalancer_leader")
    except (AssertionError, OSError):
        return 0.0  # not serving (yet, or any more)


@pytest.fixture
def replicas(
    control_plane: ControlPlane, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[dict[str, tuple[subprocess.Popen[bytes], str]]]:
    monkeypatch.delenv("POD_NAME", raising=False)
    monkeypatch.delenv("GPUDAEMON_KUBERNETES__HOLDER_IDENTITY", raising=False)
    procs: dict[str, tuple[subprocess.Popen[bytes], str]] = {}

    def start(name: str) -> str:
        addr = f"127.0.0.1:{free_port()}"
        cfg = tmp_path / f"{name}.yaml"
        cfg.write_text(yaml.safe_dump({
            "rebalance": {"interval_s": 1, "lease_duration_s": DURATION, "dry_run": True},
            "kubernetes": {"kubeconfig": str(control_plane.admin_kubeconfig)},
        }))  # fmt: skip
        proc = start_agent(["rebalance", "--config", str(cfg), "--listen", addr],
                           log=tmp_path / f"{name}.log")  # fmt: skip
        url = f"http://{addr}"
        procs[name] = (proc, url)
        wait_for(lambda: http_get(url + "/readyz")[0] == 200, 60, what=f"{name} ready")
        return url

    try:
        start("a")
        start("b")
        yield procs
    finally:
        for proc, _ in procs.values():
            stop(proc)
        with contextlib.suppress(KubeError):
            control_plane.admin.request("DELETE", LEASE)


def holder(cp: ControlPlane) -> str:
    return str(cp.admin.request("GET", LEASE)["spec"].get("holderIdentity") or "")


def test_two_replicas_on_one_host_elect_one_leader(
    control_plane: ControlPlane,
    replicas: dict[str, tuple[subprocess.Popen[bytes], str]],
    tmp_path: Path,
) -> None:
    cp = control_plane
    urls = {n: url for n, (_, url) in replicas.items()}
    wait_for(lambda: sum(leader(u) for u in urls.values()) == 1, 30, what="exactly one leader")
    # Watched over two Lease durations: never both, never neither once elected.
    end = time.monotonic() + 2 * DURATION
    while time.monotonic() < end:
        assert sum(leader(u) for u in urls.values()) == 1, "two leaders, or none"
        time.sleep(0.1)
    who = holder(cp)
    assert re.fullmatch(rf"{re.escape(socket.gethostname())}_{UUID}", who), who
    first = next(n for n, u in urls.items() if leader(u) == 1)
    other = next(n for n in urls if n != first)
    assert who in (tmp_path / f"{first}.log").read_text()

    proc, _ = replicas.pop(first)
    proc.kill()  # kill -9: no release; the other carries on once the Lease runs out
    wait_for(lambda: leader(urls[other]) == 1, 3 * DURATION, interval=0.1,
             what="the other replica to take over")  # fmt: skip
    assert holder(cp) != who and re.fullmatch(rf".*_{UUID}", holder(cp))
