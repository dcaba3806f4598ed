"""Helpers shared by the test suite: free ports, polling with a deadline, agent processes."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

T = TypeVar("T")
REPO = Path(__file__).resolve().parent.parent


class ToolsError(RuntimeError):
    """scripts/test-tools could not provide the real servers."""


def tools_bin(*tools: str) -> Path:
    """The directory holding the real servers built by scripts/test-tools (etcd,
    kube-apiserver, kube-scheduler, influxd, helm, prometheus): $GPUDAEMON_TOOLS_BIN when
    the test or bench command already ran the script, else the script's answer (a no-op
    when everything is built; `tools` limits what it builds). The one lookup for tests/
    and bench/."""
    env = os.environ.get("GPUDAEMON_TOOLS_BIN")
    if env:
        return Path(env)
    proc = subprocess.run(
        [str(REPO / "scripts" / "test-tools"), *tools], capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise ToolsError(f"scripts/test-tools failed:\n{proc.stderr[-2000:]}")
    path = Path(proc.stdout.strip().splitlines()[-1])
    os.environ["GPUDAEMON_TOOLS_BIN"] = str(path)
    return path


# Ports below Linux's ephemeral range (32768-60999 by default): a port taken with
# bind(0) comes from that range, so any outgoing connection (an agent to the API
# server, the API server to etcd) could take it before the server we hand it to binds
# it. That happened in CI. Below the range only servers bind, and each port is handed
# out once per test process.
_PORT_RANGE = (20000, 32768)
_handed_out: set[int] = set()
_rng = random.Random(os.getpid() ^ time.monotonic_ns())


def free_port() -> int:
    """A localhost port nobody listens on, outside the kernel's ephemeral range."""
    for _ in range(1000):
        port = _rng.randrange(*_PORT_RANGE)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port in {_PORT_RANGE}")


class ProcessExited(AssertionError):
    """A server under test died while we waited for it: wait_for stops at once."""


def wait_for(
    fn: Callable[[], T | None],
    timeout: float = 10.0,
    interval: float = 0.1,
    what: str = "condition",
) -> T:
    """Call fn until it returns something truthy; fail with `what` after `timeout` s.
    Exceptions count as "not yet" (a server still starting), except ProcessExited."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            v = fn()
            if v:
                return v
        except ProcessExited:
            raise
        except Exception as e:
            last = e
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last error: {last!r}")


def http_get(
    url: str, timeout: float = 5.0, headers: dict[str, str] | None = None
) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def scrape(url: str, name: str, *, required: bool = False, **labels: str) -> float:
    """The sum of a /metrics page's samples `name` carrying `labels` (0 when none, or
    an AssertionError when `required`), read with prometheus-client's own text parser.
    The one /metrics reader of the suite."""
    from prometheus_client.parser import text_string_to_metric_families

    status, body = http_get(url)
    assert status == 200, f"GET {url}: {status}"
    values = [
        s.value
        for fam in text_string_to_metric_families(body.decode())
        for s in fam.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    if required and not values:
        raise AssertionError(f"{name}{labels} not in {url}")
    return float(sum(values))


def start_agent(
    args: Sequence[str],
    env: dict[str, str] | None = None,
    log: Path | None = None,
    cwd: Path = REPO,
) -> subprocess.Popen[bytes]:
    """`gpudaemon <args>` as a real subprocess of this interpreter (`cwd` holding the
    gpudaemon package it runs: bench/memory runs an earlier commit's copy)."""
    full_env = {**os.environ, **(env or {})}
    out = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115 - owned by the process
    return subprocess.Popen(
        [sys.executable, "-m", "gpudaemon", *args],
        env=full_env,
        stdout=out,
        stderr=subprocess.STDOUT,
        cwd=cwd,
    )


# A pod's view for `start_agent_in_pod`: the service account's directory where kubelet
# would mount it (gpudaemon.incluster.SA_DIR, here a test's directory) and, when given,
# a shorter token re-read period than the minute client-go and the official loader use.
IN_POD = (
    "import pathlib, sys\n"
    "import gpudaemon.incluster as ic\n"
    "ic.SA_DIR = pathlib.Path(sys.argv.pop(1)); ic.SA_TOKEN = ic.SA_DIR / 'token'\n"
    "reread = sys.argv.pop(1)\n"
    "if reread:\n"
    "    import gpudaemon.kube.incluster as kic\n"
    "    kic.TOKEN_REREAD_S = float(reread)\n"
    "from gpudaemon.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def service_account_dir(path: Path, token: str, ca: Path, namespace: str = "gpudaemon") -> Path:
    """What kubelet mounts at /var/run/secrets/kubernetes.io/serviceaccount."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "token").write_text(token)
    (path / "ca.crt").write_bytes(ca.read_bytes())
    (path / "namespace").write_text(namespace)
    return path


def start_agent_in_pod(
    args: Sequence[str],
    sa_dir: Path,
    server: str,
    log: Path | None = None,
    token_reread_s: float | None = None,
    cwd: Path = REPO,
) -> subprocess.Popen[bytes]:
    """`gpudaemon <args>` as a pod runs it: the API server only in
    $KUBERNETES_SERVICE_HOST/PORT, credentials only in `sa_dir` (no kubeconfig)."""
    host, _, port = server.removeprefix("https://").rpartition(":")
    env = {
        k: v
        for k, v in os.environ.items()
        if k != "KUBECONFIG" and not k.startswith(("GPUDAEMON_KUBERNETES", "KUBERNETES_"))
    }
    env.update(KUBERNETES_SERVICE_HOST=host.strip("[]"), KUBERNETES_SERVICE_PORT=port)
    out = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115 - owned by the process
    reread = "" if token_reread_s is None else str(token_reread_s)
    return subprocess.Popen(
        [sys.executable, "-c", IN_POD, str(sa_dir), reread, *args],
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT,
        cwd=cwd,
    )


def stop(proc: subprocess.Popen[bytes], timeout: float = 15.0) -> int:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


class CliResult(NamedTuple):
    returncode: int
    stdout: str
    stderr: str


def run_cli(*args: str) -> CliResult:
    """`gpudaemon <args>` in this process (cli.main), with its stdout, stderr and exit
    code: an interpreter start costs more than most CLI cases themselves. The process's
    environment is what the command sees (use monkeypatch to change it)."""
    import contextlib
    import io
    import signal

    from gpudaemon import cli
    from gpudaemon.logsetup import setup_logging

    out, err = io.StringIO(), io.StringIO()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = cli.main(list(args))
            except SystemExit as e:  # argparse
                rc = e.code if isinstance(e.code, int) else 2
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        setup_logging("WARNING")  # back to this process's stderr, not the buffer
    return CliResult(rc, out.getvalue(), err.getvalue())


def cli_process(
    *args: str,
    env: dict[str, str] | None = None,
    cwd: Path = REPO,
    stdin: Any = subprocess.DEVNULL,
    timeout: float = 60,
) -> CliResult:
    """`gpudaemon <args>` as a real subprocess (for exit codes and the stderr a user
    sees); a hang is a failure after `timeout`, not a stuck test run."""
    p = subprocess.run(
        [sys.executable, "-m", "gpudaemon", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        stdin=stdin,
        env={**os.environ, **(env or {})},
    )
    return CliResult(p.returncode, p.stdout, p.stderr)
