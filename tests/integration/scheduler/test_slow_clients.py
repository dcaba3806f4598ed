"""Every server stays up under its own traffic (issue 28, Done-when 6), on a real etcd,
kube-apiserver and kube-scheduler, with `gpudaemon extender` as real processes the way
the chart runs them:

1. service mode (mutual TLS): silent TCP connections held open to the extender's port
   delay neither an mTLS client with the scheduler's certificate (under 1 s) nor a real
   kube-scheduler's first calls (its pod binds as fast as without them); the server
   closes the silent connections after its handshake time-out;
2. loopback: 300 clients that open connections and trickle their headers (more than
   the 256-connection limit, reconnecting when closed) make no real /filter time out,
   from a fresh connection or from a real kube-scheduler;
3. loopback: 400 clients that each get one /healthz answered and then trickle a
   /filter body (no longer strangers) delay no real /filter past 1 s.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.certs import Pki, make_pki
from tests.integration.kube.controlplane import ADMISSION, RBAC, ControlPlane
from tests.integration.scheduler.rig import SchedulerRig
from tests.integration.scheduler.test_safety import Proc, start_extender
from tests.support import wait_for

pytestmark = pytest.mark.integration

TLS_SCHED = "slow-tls-scheduler"
LOOP_SCHED = "slow-loopback-scheduler"
HTTP_TIMEOUT_S = 5.0  # kube-scheduler's extender httpTimeout in the chart


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def servers(tools_bin: Path, pki: Pki) -> Iterator[tuple[SchedulerRig, Proc, Proc, list[str]]]:
    """Both extenders and a node group, but no kube-scheduler yet: each test starts its
    own, so that its first call to the extender happens under the test's load."""
    cp = ControlPlane(tools_bin)
    rig = SchedulerRig(cp)
    try:
        cp.start()
        cp.apply_manifest(RBAC)
        cp.apply_manifest(ADMISSION)
        loop_ext = start_extender(rig, "extender-loop", LOOP_SCHED)
        tls_ext = start_extender(
            rig,
            "extender-tls",
            TLS_SCHED,
            tls={"cert_file": pki.server.cert, "key_file": pki.server.key,
                 "client_ca_file": pki.ca},
        )  # fmt: skip
        nodes = [f"slow-{i}" for i in range(4)]
        for n in nodes:
            rig.add_node(n, "slow")
        rig.run_agents(nodes)
        yield rig, loop_ext, tls_ext, nodes
    finally:
        rig.stop()
        cp.stop()


def filter_body(nodes: list[str]) -> bytes:
    pod = {
        "metadata": {"name": "probe", "namespace": "default", "uid": ""},
        "spec": {
            "schedulerName": "x",
            "containers": [{"name": "c", "resources": {"requests": {"nvidia.com/gpu": "1"}}}],
        },
    }
    return json.dumps({"Pod": pod, "NodeNames": nodes}).encode()


def timed_filter(conn: http.client.HTTPConnection, nodes: list[str]) -> float:
    t0 = time.monotonic()
    conn.request("POST", "/filter", filter_body(nodes), {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200, r.read()
    assert json.loads(r.read())["NodeNames"]
    return time.monotonic() - t0


def bind_seconds(rig: SchedulerRig, scheduler: str) -> float:
    t0 = time.monotonic()
    rig.wait_bound(rig.create_pod(1, "slow", scheduler=scheduler), timeout=60)
    return time.monotonic() - t0


def test_silent_connections_do_not_delay_mutual_tls_calls(
    servers: tuple[SchedulerRig, Proc, Proc, list[str]], pki: Pki
) -> None:
    rig, _, tls_ext, nodes = servers
    port = tls_ext.ports["port"]
    silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(5)]
    try:
        time.sleep(0.5)  # the scenario: connections that have said nothing for a while
        ctx = ssl.create_default_context(cafile=pki.ca)
        ctx.load_cert_chain(pki.client.cert, pki.client.key)
        for _ in range(3):  # a new connection each time: a handshake behind the silent ones
            conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=30)
            try:
                assert timed_filter(conn, nodes) < 1.0
            finally:
                conn.close()
        rig.start_scheduler(
            TLS_SCHED,
            True,
            url=f"https://127.0.0.1:{port}",
            tls={"certFile": pki.client.cert, "keyFile": pki.client.key, "caFile": pki.ca},
        )
        # The scheduler's first pod: its first connection, handshake and /filter,
        # made while the silent connections are open.
        assert bind_seconds(rig, TLS_SCHED) < 3.0
        # A silent connection is not kept past the handshake time-out (5 s).
        s = silent[0]
        s.settimeout(10)
        assert s.recv(1) == b""
    finally:
        for s in silent:
            s.close()


class Tricklers:
    """`n` connections that each send one header byte every `every_s`, reconnecting when
    the server closes one: an attacker holding connection slots without a thread each."""

    def __init__(self, port: int, n: int, every_s: float = 0.5) -> None:
        self.port, self.n, self.every_s = port, n, every_s
        self.stop = threading.Event()
        self.reconnects = 0
        self._conns: list[tuple[socket.socket, int]] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def trickling(self) -> int:
        """Connections that have sent a byte: open, or waiting in the backlog."""
        return sum(1 for _, sent in list(self._conns) if sent)

    def _open(self) -> tuple[socket.socket, int]:
        s = socket.socket()
        s.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            s.connect(("127.0.0.1", self.port))
        return s, 0

    def _run(self) -> None:
        head = b"POST /filter HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"y" * 100_000
        self._conns = conns = [self._open() for _ in range(self.n)]
        while not self.stop.wait(self.every_s):
            for i, (s, sent) in enumerate(conns):
                try:
                    conns[i] = (s, sent + s.send(head[sent : sent + 1]))
                except (BlockingIOError, InterruptedError):
                    pass  # still in the backlog
                except OSError:
                    s.close()
                    conns[i] = self._open()
                    self.reconnects += 1
        for s, _ in conns:
            s.close()

    def __enter__(self) -> Tricklers:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)


def test_300_slow_clients_make_no_filter_time_out_on_loopback(
    servers: tuple[SchedulerRig, Proc, Proc, list[str]],
) -> None:
    rig, loop_ext, _, nodes = servers
    port = loop_ext.ports["port"]
    with Tricklers(port, 300) as slow:
        # Every slot (256) is held by a trickler, the rest wait in the backlog (one the
        # server closes starts over, so not all 300 need show a byte at once).
        wait_for(lambda: slow.trickling() >= 256, 30, what="256 clients trickling headers")
        rig.start_scheduler(LOOP_SCHED, True, url=f"http://127.0.0.1:{port}")
        worst = 0.0
        deadline = time.monotonic() + 25  # past the read time-out: the tricklers churn
        while time.monotonic() < deadline:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=HTTP_TIMEOUT_S)
            try:
                worst = max(worst, timed_filter(conn, nodes))
            finally:
                conn.close()
            time.sleep(0.5)  # /filter calls spread over the 25 s under test
        binds = [bind_seconds(rig, LOOP_SCHED) for _ in range(3)]
        assert slow.reconnects > 0  # the server did close slow clients
    assert worst < HTTP_TIMEOUT_S, worst
    assert max(binds) < HTTP_TIMEOUT_S, binds


class BodyTricklers:
    """`n` clients that each get one /healthz answered on their connection, then send a
    /filter's headers and trickle its body a byte every `every_s`, starting over when
    the server closes them: served clients, not strangers, holding connection slots."""

    HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    HEAD = b"POST /filter HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    HEAD += b"Content-Length: 100000\r\n\r\n{"

    def __init__(self, port: int, n: int, every_s: float = 0.5) -> None:
        self.port, self.n, self.every_s = port, n, every_s
        self.stop = threading.Event()
        self.served = 0  # /healthz answers read
        self.reconnects = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _open(self) -> list[Any]:
        s = socket.socket()
        s.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            s.connect(("127.0.0.1", self.port))
        return [s, "ask", b""]

    def trickling(self) -> int:
        return sum(1 for c in self._conns if c[1] == "body")

    def _step(self, c: list[Any], trickle: bool) -> None:
        s, state, buf = c
        if state == "ask":
            s.send(self.HEALTHZ)
            c[1] = "answer"
        elif state == "answer":
            data = s.recv(65536)
            if not data:
                raise ConnectionResetError
            c[2] = buf + data
            if b"\r\n\r\n" in c[2]:
                self.served += 1
                s.send(self.HEAD)
                c[1], c[2] = "body", b""
        elif trickle:
            s.send(b" ")
            if s.recv(65536, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                raise ConnectionResetError

    def _run(self) -> None:
        self._conns = [self._open() for _ in range(self.n)]
        last = time.monotonic()
        while not self.stop.wait(0.05):
            trickle = time.monotonic() - last >= self.every_s
            if trickle:
                last = time.monotonic()
            for i, c in enumerate(self._conns):
                try:
                    self._step(c, trickle)
                except (BlockingIOError, InterruptedError):
                    pass  # still in the backlog, or nothing to read yet
                except OSError:
                    c[0].close()
                    self._conns[i] = self._open()
                    self.reconnects += 1
        for c in self._conns:
            c[0].close()

    def __enter__(self) -> BodyTricklers:
        self._conns: list[list[Any]] = []
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)


def test_400_clients_trickling_a_body_after_a_good_request_delay_no_filter_past_1_s(
    servers: tuple[SchedulerRig, Proc, Proc, list[str]],
) -> None:
    _, loop_ext, _, nodes = servers
    port = loop_ext.ports["port"]
    with BodyTricklers(port, 400) as slow:
        # Every slot (256) is held by a client the server has answered.
        wait_for(lambda: slow.trickling() >= 256, 30, what="256 clients trickling bodies")
        time.sleep(2)  # past the slow mark (1 s), well before the read time-out (10 s)
        times = []
        for _ in range(10):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=HTTP_TIMEOUT_S)
            try:
                times.append(timed_filter(conn, nodes))
            finally:
                conn.close()
            time.sleep(0.3)  # calls spread over time, while the clients trickle
        assert slow.served > 256
    assert max(times) < 1.0, times
