"""Every client error is one line, against a real kube-apiserver (issue 28): a kubeconfig
whose CA did not sign the server's certificate (made by tests/certs.py) gave `status` a
95-line traceback, made `rebalance` exit and filled the extender's log. Now `status`
exits 1 with one line naming the server and the cause, and the long-running programs
stay up, log the failure once per watch and retry. `insecure-skip-tls-verify` is one
WARNING line, not urllib3's warning block on every request, and a PATCH over the API
server's body limit is one line of ours."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from gpudaemon.errors import KubeInvalidError
from tests.certs import make_pki
from tests.integration.kube.controlplane import ControlPlane
from tests.support import REPO, free_port, http_get, start_agent, stop, wait_for

pytestmark = pytest.mark.integration

MISMATCH = "TLS: certificate verify failed"
HINT = "(the kubeconfig's CA does not match the server)"


def kubeconfig(cp: ControlPlane, path: Path, cluster: dict[str, object]) -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "t",
        "clusters": [{"name": "t", "cluster": {"server": cp.server, **cluster}}],
        "users": [{"name": "admin", "user": {"token": "admin-token"}}],
        "contexts": [{"name": "t", "context": {"cluster": "t", "user": "admin"}}],
    }))  # fmt: skip
    return path


@pytest.fixture
def wrong_ca(control_plane: ControlPlane, tmp_path: Path) -> Path:
    pki = make_pki(tmp_path)  # a CA that did not sign the API server's certificate
    return kubeconfig(control_plane, tmp_path / "wrong-ca", {"certificate-authority": pki.ca})


@pytest.fixture
def insecure(control_plane: ControlPlane, tmp_path: Path) -> Path:
    return kubeconfig(control_plane, tmp_path / "insecure", {"insecure-skip-tls-verify": True})


def gpudaemon(*args: str) -> subprocess.CompletedProcess[str]:
    """A real process: warnings and their filters are per process."""
    return subprocess.run([sys.executable, "-m", "gpudaemon", *args], capture_output=True,
                          text=True, timeout=120, cwd=REPO)  # fmt: skip


def test_status_with_a_ca_that_does_not_match_is_one_line(
    control_plane: ControlPlane, wrong_ca: Path
) -> None:
    p = gpudaemon("status", "--kubeconfig", str(wrong_ca))
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 1 and len(lines) == 1, p.stderr
    assert lines[0].startswith(f"gpudaemon: GET {control_plane.server}/api/v1/nodes")
    assert MISMATCH in lines[0] and HINT in lines[0]


@pytest.mark.parametrize("program", ["rebalance", "extender"])
def test_a_long_running_program_with_the_wrong_ca_stays_up_and_logs_once(
    control_plane: ControlPlane, wrong_ca: Path, tmp_path: Path, program: str
) -> None:
    addr = f"127.0.0.1:{free_port()}"
    section = "rebalance" if program == "rebalance" else "extender"
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({
        section: {"listen": addr},
        "kubernetes": {"kubeconfig": str(wrong_ca), "backoff_max_seconds": 1},
    }))  # fmt: skip
    log = tmp_path / f"{program}.log"
    proc = start_agent([program, "--config", str(cfg)], log=log)
    try:
        wait_for(lambda: http_get(f"http://{addr}/healthz")[0] == 200, 60, what="serving")
        wait_for(lambda: MISMATCH in log.read_text(), 30, what="the TLS failure logged")
        time.sleep(8)  # a dozen retries at a backoff capped at 1 s
        assert proc.poll() is None, log.read_text()[-3000:]
        assert http_get(f"http://{addr}/readyz")[0] == 503  # not ready: no first list
        text = log.read_text()
        assert "Traceback" not in text, text[-3000:]
        tls = [ln for ln in text.splitlines() if MISMATCH in ln]
        assert all(HINT in ln for ln in tls)
        # Once per watch (and once a minute for the leader election), not per retry.
        watches = {ln.split(" watch failed")[0].split()[-1] for ln in tls if "watch" in ln}
        assert len(tls) <= len(watches) + 1, "\n".join(tls)
    finally:
        stop(proc)


def test_the_agent_with_the_wrong_ca_logs_once_and_keeps_polling(
    control_plane: ControlPlane, wrong_ca: Path, tmp_path: Path
) -> None:
    node = f"gpu-{uuid.uuid4().hex[:8]}"
    control_plane.create_node(node)
    addr = f"127.0.0.1:{free_port()}"
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(yaml.safe_dump({
        "node_name": node, "simulate": "dgx-h100", "labels": {"to": "apiserver"},
        "metrics": {"listen": addr}, "schedules": {"labels": "* * * * * *"},
        "kubernetes": {"kubeconfig": str(wrong_ca), "backoff_max_seconds": 1},
    }))  # fmt: skip
    log = tmp_path / "agent.log"
    proc = start_agent(["run", "--config", str(cfg)], log=log)
    try:
        wait_for(lambda: MISMATCH in log.read_text(), 60, what="the TLS failure logged")
        time.sleep(8)  # eight label runs, each failing
        assert proc.poll() is None
        assert http_get(f"http://{addr}/metrics")[0] == 200  # the readings still serve
        text = log.read_text()
        assert "Traceback" not in text, text[-3000:]
        tls = [ln for ln in text.splitlines() if MISMATCH in ln]
        assert 1 <= len(tls) <= 3 and all(HINT in ln for ln in tls), "\n".join(tls)
    finally:
        stop(proc)


def test_insecure_skip_tls_verify_is_one_warning_line(
    control_plane: ControlPlane, insecure: Path, tmp_path: Path
) -> None:
    p = gpudaemon("status", "--kubeconfig", str(insecure))
    assert p.returncode == 0, p.stderr
    assert "InsecureRequestWarning" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "WARNING" in lines[0], p.stderr
    assert "insecure-skip-tls-verify" in lines[0] and control_plane.server in lines[0]

    node = f"gpu-{uuid.uuid4().hex[:8]}"
    control_plane.create_node(node)
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(yaml.safe_dump({
        "node_name": node, "simulate": "dgx-h100", "labels": {"to": "apiserver"},
        "metrics": {"listen": "127.0.0.1:0"}, "kubernetes": {"kubeconfig": str(insecure)},
    }))  # fmt: skip
    p = gpudaemon("run", "--once", "--config", str(cfg))
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout + p.stderr
    assert "InsecureRequestWarning" not in out
    assert sum("insecure-skip-tls-verify" in ln for ln in out.splitlines()) == 1, out[-3000:]
    assert control_plane.node(node)["metadata"]["labels"]["gpudaemon.io/gpu.count"] == "8"


@pytest.mark.parametrize("mib", [4, 64])
def test_a_patch_over_the_body_limit_is_one_line_of_ours(
    control_plane: ControlPlane, node: str, mib: int
) -> None:
    big = {"metadata": {"annotations": {"example.com/big": "x" * (mib << 20)}}}
    with pytest.raises(KubeInvalidError) as e:
        control_plane.admin.patch_node(node, big)
    assert e.value.status == 413 and "\n" not in str(e.value)
    assert str(e.value).startswith(f"PATCH /api/v1/nodes/{node}: request body of ")
