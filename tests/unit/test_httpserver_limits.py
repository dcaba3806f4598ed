"""gpudaemon.httpserver's defences against slow and large clients (issue 28), over real
sockets on 127.0.0.1: the read time-out closes a client that trickles its headers or
never speaks, while a connection that finished a request keeps its idle time-out; at
the connection limit a newcomer is let in and the stalest stranger closed, or a client
trickling a request after good ones; a body over
the cap is a 413 naming the setting, sent before the body is read; bodies past the
in-flight budget are a prompt 503 and the budget comes back."""

from __future__ import annotations

import http.client
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from gpudaemon.errors import UsageError
from gpudaemon.httpserver import HttpServer, limits
from tests.support import wait_for
from tests.unit.test_httpserver import echo, request


def closed_by_server(s: socket.socket, within_s: float) -> float:
    """Seconds until the server closed `s` (recv gives b"" or a reset); fails the test
    if it is still open after `within_s`."""
    t0 = time.monotonic()
    s.settimeout(within_s)
    try:
        while s.recv(1024):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        pytest.fail(f"the server kept the connection open for {within_s} s")
    return time.monotonic() - t0


@pytest.fixture
def quick() -> Iterator[HttpServer]:
    srv = HttpServer(
        "127.0.0.1:0", echo, name="test", threads=2, read_timeout_s=1, idle_timeout_s=30,
        max_body_bytes=1000, max_connections=4,
    )  # fmt: skip
    srv.start()
    yield srv
    srv.stop()


def test_a_client_that_trickles_its_headers_is_closed_at_the_read_time_out(
    quick: HttpServer,
) -> None:
    """Each byte arrives well inside any per-read time-out; the request as a whole does
    not arrive in time, so the connection goes."""
    s = socket.create_connection(("127.0.0.1", quick.port), timeout=5)
    stop = threading.Event()

    def trickle() -> None:
        for b in b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"y" * 200:
            if stop.wait(0.2):
                return
            try:
                s.send(bytes([b]))
            except OSError:
                return

    t = threading.Thread(target=trickle)
    t.start()
    try:
        assert closed_by_server(s, within_s=5) < 4
    finally:
        stop.set()
        t.join()
        s.close()


def test_a_silent_connection_is_closed_but_a_served_one_keeps_its_idle_time(
    quick: HttpServer,
) -> None:
    silent = socket.create_connection(("127.0.0.1", quick.port))
    kept = http.client.HTTPConnection("127.0.0.1", quick.port, timeout=10)
    kept.request("GET", "/once")
    assert kept.getresponse().read() == b"/once"
    assert closed_by_server(silent, within_s=5) < 4
    time.sleep(1.5)  # past the read time-out: the served connection is idle, not slow
    kept.request("GET", "/again")
    assert kept.getresponse().read() == b"/again"
    kept.close()
    silent.close()


def test_at_the_connection_limit_a_newcomer_is_served_and_the_oldest_stranger_goes() -> None:
    srv = HttpServer("127.0.0.1:0", echo, name="test", threads=2, max_connections=4)
    srv.start()
    try:
        silent = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(4)]
        time.sleep(limits.SLOW_REQUEST_S + 0.3)  # silent past the slow mark
        t0 = time.monotonic()
        assert request(srv.port, path="/in") == (200, b"/in")
        assert time.monotonic() - t0 < 1.0  # not after a read time-out (10 s)
        assert closed_by_server(silent[0], within_s=2) < 2  # the oldest made room
        assert srv.shed >= 1
        for s in silent:
            s.close()
    finally:
        srv.stop()


def test_at_the_limit_a_client_trickling_a_body_after_a_good_request_makes_room() -> None:
    srv = HttpServer("127.0.0.1:0", echo, name="test", threads=2, max_connections=4)
    srv.start()
    try:
        slow = []
        for _ in range(4):  # each answers one request, then trickles the next one's body
            c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
            c.request("GET", "/healthz")
            assert c.getresponse().read() == b"/healthz"
            assert c.sock is not None
            c.sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\na")
            slow.append(c.sock)
        time.sleep(limits.SLOW_REQUEST_S + 1.2)  # past the slow mark, far from the 10 s one
        t0 = time.monotonic()
        assert request(srv.port, path="/in") == (200, b"/in")
        assert time.monotonic() - t0 < 1.0  # not after the read time-out (10 s)
        assert closed_by_server(slow[0], within_s=2) < 2  # the oldest request made room
        assert srv.shed >= 1
        for s in slow:
            s.close()
    finally:
        srv.stop()


def test_a_request_still_arriving_under_the_slow_mark_is_not_shed() -> None:
    srv = HttpServer("127.0.0.1:0", echo, name="test", threads=2, max_connections=1)
    srv.start()
    try:
        c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
        c.request("GET", "/healthz")
        assert c.getresponse().read() == b"/healthz"
        assert c.sock is not None
        c.sock.sendall(b"POST /mine HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\na")
        wait_held(srv, 2)  # its request has begun
        newcomer = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        # Time for the server to (wrongly) cut the arriving request off for the
        # newcomer, still under the slow mark: the newcomer waits in the backlog.
        time.sleep(0.2)
        c.sock.sendall(b"b")
        c.sock.settimeout(5)
        answer = b""
        while not answer.endswith(b"\r\n\r\nab") and (chunk := c.sock.recv(4096)):
            answer += chunk
        # Answered whole: not cut off for the newcomer (now idle, it may make room).
        assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b"ab")
        newcomer.close()
        c.close()
    finally:
        srv.stop()


def test_413_names_the_cap_and_comes_before_the_body(quick: HttpServer) -> None:
    with socket.create_connection(("127.0.0.1", quick.port), timeout=5) as s:
        s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n")
        answer = b""
        while chunk := s.recv(1000):  # the server answers and closes: no body is awaited
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413 ")
    assert b"the body (5000 bytes) is over test.max_body_bytes (1000)" in answer


def wait_held(srv: HttpServer, want: int) -> None:
    """Until the budget's bytes held read `want`: the loop thread takes and gives them
    back just after the bytes or the answer cross the socket."""
    wait_for(lambda: srv.budget.held == want, 10, interval=0.01, what=f"{want} body bytes held")


def test_bodies_past_the_budget_are_a_prompt_503_and_the_budget_comes_back() -> None:
    srv = HttpServer("127.0.0.1:0", echo, name="test", max_body_bytes=1000, body_budget_bytes=1500)
    srv.start()
    try:
        # One body of 1,000 bytes announced and half sent: its bytes are held.
        holder = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        holder.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n" + b"a" * 500)
        wait_held(srv, 1000)
        t0 = time.monotonic()
        status, body = request(srv.port, "POST", "/", b"b" * 600)
        assert status == 503 and b"test.body_budget_bytes (1500)" in body
        assert time.monotonic() - t0 < 1.0
        assert request(srv.port, "POST", "/", b"c" * 400) == (200, b"c" * 400)  # fits beside
        holder.sendall(b"a" * 500)
        assert holder.recv(1000).startswith(b"HTTP/1.1 200 ")
        holder.close()
        wait_held(srv, 0)  # given back once waitress closes the request
        assert request(srv.port, "POST", "/", b"d" * 1000) == (200, b"d" * 1000)
        wait_held(srv, 0)
        # A client that drops mid-body gives its share back too.
        cut = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        cut.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\nxx")
        wait_held(srv, 1000)
        cut.close()
        wait_held(srv, 0)
    finally:
        srv.stop()


def test_a_budget_below_the_cap_is_one_line() -> None:
    with pytest.raises(UsageError, match="body_budget_bytes >= max_body_bytes"):
        HttpServer("127.0.0.1:0", echo, name="x", max_body_bytes=1000, body_budget_bytes=10)


def test_a_stranger_whose_request_waits_unread_is_not_taken_for_silent() -> None:
    """On a loaded loop a new connection's request can sit in its socket for over the
    slow mark before the loop reads it: that client has spoken, and the scheduler's
    fresh connection must not be cut off for the loop's delay (it once was, in CI, with
    400 clients reconnecting)."""
    from types import SimpleNamespace

    spoke_server, spoke_client = socket.socketpair()
    silent_server, silent_client = socket.socketpair()
    try:
        spoke_client.sendall(b"POST /filter HTTP/1.1\r\n")
        now = time.time()
        old = now - limits.SLOW_REQUEST_S - 1

        def stranger(sock: socket.socket, created: float) -> SimpleNamespace:
            return SimpleNamespace(served=0, requests=[], pending_since=None, creation_time=created,
                                   last_activity=created, socket=sock)  # fmt: skip

        spoke = stranger(spoke_server, old - 5)  # the oldest, but its bytes wait unread
        silent = stranger(silent_server, old)
        assert limits._Server._stalest([spoke, silent], now) is silent
        assert limits._Server._stalest([spoke], now) is None  # alone, it waits its turn
        # Peeking consumed nothing: the loop still reads the whole request line.
        assert spoke_server.recv(100) == b"POST /filter HTTP/1.1\r\n"
    finally:
        for s in (spoke_server, spoke_client, silent_server, silent_client):
            s.close()


def test_clients_streaming_blank_lines_are_slow_and_closed_at_the_read_time_out() -> None:
    """waitress reads each blank line as an empty request and starts a new parser: a
    client that streams them never finishes a request. Its request clock starts with
    its first byte and is not reset by them, so it makes room for a newcomer once over
    the slow mark and is closed at the read time-out (before, four such clients held
    every slot for good and a real request timed out)."""
    srv = HttpServer(
        "127.0.0.1:0", echo, name="test", threads=2, read_timeout_s=3, max_connections=4
    )
    srv.start()
    stop = threading.Event()
    closed: list[float] = []
    t_start = time.monotonic()

    def stream() -> None:
        try:
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=1)
            chunk = b"\r\n\r\n" * 16384
            while not stop.is_set():
                s.sendall(chunk)
        except OSError:  # closed by the server (or the send timed out: held up)
            closed.append(time.monotonic() - t_start)

    threads = [threading.Thread(target=stream) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        time.sleep(limits.SLOW_REQUEST_S + 0.5)  # every slot streaming past the slow mark
        t0 = time.monotonic()
        assert request(srv.port, path="/in") == (200, b"/in")
        assert time.monotonic() - t0 < 3.0
        assert srv.shed >= 1
        wait_for(lambda: len(closed) == 4, 15, what="every blank-line client closed")
        assert max(closed) < 10  # by the read time-out (3 s), with the loop kept busy
    finally:
        stop.set()
        for t in threads:
            t.join()
        srv.stop()
