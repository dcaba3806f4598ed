"""/metrics of a real `gpudaemon run` under load, over real sockets (issue 12, item 18):
200 concurrent keep-alive clients x 10 scrapes each, then the same while 300 idle
connections are held open. Every request must succeed within Prometheus's default
scrape time-out (10 s), and the agent's thread count must stay bounded (the old server
started one thread per connection: 300 idle connections left 308 threads)."""

from __future__ import annotations

import http.client
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import free_port, http_get, start_agent, stop, wait_for

pytestmark = pytest.mark.integration

CLIENTS, PER_CLIENT, IDLE = 200, 10, 300
SCRAPE_TIMEOUT_S = 10.0  # Prometheus's default scrape_timeout
THREAD_SLACK = (
    16  # the agent's own pools may still grow a little; 300 per-connection threads may not
)


def threads_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError(f"no thread count for pid {pid}")


@pytest.fixture(scope="module")
def agent(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    work = tmp_path_factory.mktemp("http-load")
    port = free_port()
    proc = start_agent(
        [
            "run",
            "--simulate",
            "dgx-h100",
            "--seed",
            "0",
            "--node-name",
            "load-node",
            "--listen",
            f"127.0.0.1:{port}",
            "--labels-to",
            str(work / "labels.json"),
        ],
        log=work / "agent.log",
    )
    try:
        wait_for(
            lambda: http_get(f"http://127.0.0.1:{port}/readyz")[0] == 200, 30, what="agent ready"
        )
        yield port, proc
    finally:
        stop(proc)


class PeakThreads:
    """Samples the agent's thread count every 5 ms while the load runs."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak = pid, 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, threads_of(self.pid))
            self._done.wait(0.005)

    def __enter__(self) -> PeakThreads:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()


def hammer(port: int, clients: int, per_client: int) -> tuple[int, list[str]]:
    """`clients` threads, each scraping `per_client` times over one keep-alive connection
    (reconnecting if the server closes it). Returns (successes, one line per failure)."""
    ok = [0] * clients
    failures: list[str] = []
    start = threading.Barrier(clients)

    def client(i: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=SCRAPE_TIMEOUT_S)
        start.wait()
        for _ in range(per_client):
            try:
                conn.request("GET", "/metrics")
                resp = conn.getresponse()
                body = resp.read()
                if resp.status == 200 and b"gpudaemon_gpu_power_watts{" in body:
                    ok[i] += 1
                else:
                    failures.append(f"status {resp.status}, {len(body)} bytes")
            except (OSError, http.client.HTTPException) as e:
                failures.append(f"{type(e).__name__}: {e}")
                conn.close()
        conn.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(ok), failures


def test_200_concurrent_clients_all_succeed_with_bounded_threads(
    agent: tuple[int, subprocess.Popen[bytes]],
) -> None:
    port, proc = agent
    baseline = threads_of(proc.pid)
    with PeakThreads(proc.pid) as threads:
        ok, failures = hammer(port, CLIENTS, PER_CLIENT)
    assert failures == [] and ok == CLIENTS * PER_CLIENT
    assert threads.peak <= baseline + THREAD_SLACK, (baseline, threads.peak)


def test_300_idle_connections_take_no_threads_and_starve_no_scrape(
    agent: tuple[int, subprocess.Popen[bytes]],
) -> None:
    port, proc = agent
    baseline = threads_of(proc.pid)
    idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(IDLE)]
    try:
        with PeakThreads(proc.pid) as threads:
            # Every idle connection was accepted (the first scrape below proves the
            # server is past them), and scrapes still go through while they are held.
            ok, failures = hammer(port, CLIENTS, 2)
        assert failures == [] and ok == CLIENTS * 2
        assert threads.peak <= baseline + THREAD_SLACK, (baseline, threads.peak)
        assert threads_of(proc.pid) <= baseline + THREAD_SLACK
    finally:
        for s in idle:
            s.close()
    assert proc.poll() is None
