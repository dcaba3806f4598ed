"""gpudaemon.httpserver: the server the agent and the extender share, over real sockets
on 127.0.0.1 (bad listen values, port conflicts, the body limit, idle time-out, the
thread bound, clean and idempotent stop)."""

from __future__ import annotations

import http.client
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest

from gpudaemon.errors import UsageError
from gpudaemon.httpserver import HttpServer, parse_listen
from tests.support import wait_for

StartResponse = Callable[..., Any]


def echo(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
    body = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
    if environ["PATH_INFO"] == "/boom":
        raise RuntimeError("the app failed")
    out = body or environ["PATH_INFO"].encode()
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(out)))])
    return [out]


@pytest.fixture
def server() -> Iterator[HttpServer]:
    srv = HttpServer("127.0.0.1:0", echo, name="test", threads=3, max_body_bytes=1000)
    srv.start()
    yield srv
    srv.stop()


def request(
    port: int,
    method: str = "GET",
    path: str = "/",
    body: bytes | None = None,
    host: str = "127.0.0.1",
) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(host, port, timeout=10)
    try:
        conn.request(method, path, body=body)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


@pytest.mark.parametrize(
    "listen, words",
    [
        ("9445", "has no port"),
        ("localhost", "has no port"),
        ("host:port", "port must be a number"),
        ("host:99999", "port must be a number"),
        ("host:-1", "port must be a number"),
        (":", "port must be a number"),
        ("::1:9445", "write an IPv6 address as [addr]:port"),
        ("[::1", "is not [ipv6-address]:port"),
        ("[::1]9445", "is not [ipv6-address]:port"),
    ],
)
def test_a_bad_listen_value_is_one_line_naming_the_setting(listen: str, words: str) -> None:
    with pytest.raises(UsageError) as e:
        HttpServer(listen, echo, name="extender")
    msg = str(e.value)
    assert msg.startswith("extender.listen: ") and words in msg and "\n" not in msg


def test_listen_forms() -> None:
    assert parse_listen("0.0.0.0:9445", "x") == ("0.0.0.0", 9445)
    assert parse_listen(":9445", "x") == ("0.0.0.0", 9445)
    assert parse_listen("[::1]:9446", "x") == ("::1", 9446)
    assert parse_listen("localhost:0", "x") == ("localhost", 0)
    assert parse_listen(("127.0.0.1", 80), "x") == ("127.0.0.1", 80)


def test_an_unknown_host_fails_at_start_with_one_line() -> None:
    srv = HttpServer("no-such-host.invalid:9445", echo, name="metrics")
    with pytest.raises(UsageError, match=r"^metrics\.listen: cannot listen on no-such-host"):
        srv.start()


def test_a_port_in_use_fails_with_one_line_and_leaves_the_owner_serving(
    server: HttpServer,
) -> None:
    other = HttpServer(f"127.0.0.1:{server.port}", echo, name="metrics")
    with pytest.raises(UsageError) as e:
        other.start()
    assert str(e.value) == (
        f"metrics.listen: cannot listen on 127.0.0.1:{server.port}: Address already in use "
        "(another process is listening there)"
    )
    other.stop()  # a server that never started stops quietly
    assert request(server.port, path="/still-here") == (200, b"/still-here")


def test_port_zero_binds_a_free_port_and_serves(server: HttpServer) -> None:
    assert server.port > 0
    assert request(server.port, "POST", "/x", b'{"a": 1}') == (200, b'{"a": 1}')


def test_a_host_name_binds_its_ipv4_address_as_before() -> None:
    srv = HttpServer("localhost:0", echo, name="test")
    srv.start()
    try:
        assert request(srv.port, path="/four") == (200, b"/four")
    finally:
        srv.stop()


def test_ipv6_loopback() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 in this kernel")
    srv = HttpServer("[::1]:0", echo, name="test")
    try:
        srv.start()
    except UsageError as e:
        pytest.skip(f"no IPv6 loopback here: {e}")
    try:
        assert request(srv.port, path="/six", host="::1") == (200, b"/six")
    finally:
        srv.stop()


def test_a_body_over_the_limit_gets_413_and_one_at_the_limit_is_served(
    server: HttpServer,
) -> None:
    assert request(server.port, "POST", "/", b"x" * 1000) == (200, b"x" * 1000)
    status, _ = request(server.port, "POST", "/", b"x" * 1001)
    assert status == 413


def test_413_is_sent_from_the_headers_without_reading_the_body(server: HttpServer) -> None:
    """A client announcing 1 GB gets its answer at once; the server never buffers it."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000\r\n\r\n")
        assert s.recv(100).startswith(b"HTTP/1.1 413 ")


def test_a_chunked_body_over_the_limit_gets_413(server: HttpServer) -> None:
    """No Content-Length to check up front: the limit holds while the body arrives."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        s.sendall(b"".join(b"64\r\n" + b"y" * 100 + b"\r\n" for _ in range(11)))
        assert s.recv(100).startswith(b"HTTP/1.1 413 ")


def test_an_app_error_is_a_500_without_a_traceback_and_the_server_goes_on(
    server: HttpServer,
) -> None:
    status, body = request(server.port, path="/boom")
    assert status == 500 and b"Traceback" not in body and b"the app failed" not in body
    assert request(server.port, path="/after") == (200, b"/after")


def test_garbage_is_a_400_not_a_crash(server: HttpServer) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"\x16\x03\x01 not http at all\r\n\r\n")
        assert s.recv(100).startswith(b"HTTP/1.0 400 ")
    assert request(server.port, path="/after") == (200, b"/after")


def new_threads(before: set[threading.Thread], *ours: threading.Thread) -> int:
    """Threads started since `before` that are not the test's own (a thread of an earlier
    test that is still exiting is in `before`, so it cannot make a count flaky)."""
    return sum(1 for t in threading.enumerate() if t not in before and t not in ours)


def all_exited(before: set[threading.Thread]) -> None:
    wait_for(lambda: new_threads(before) == 0, 10, what="the server's threads to exit")


def test_threads_stay_bounded_with_many_idle_and_busy_connections() -> None:
    before = set(threading.enumerate())
    srv = HttpServer("127.0.0.1:0", echo, name="test", threads=4)
    srv.start()
    try:
        started = new_threads(before)
        assert started == 5  # the loop + 4 app threads, made once
        idle = [socket.create_connection(("127.0.0.1", srv.port), timeout=10) for _ in range(300)]
        results: list[tuple[int, bytes]] = []

        def client(i: int) -> None:
            for j in range(5):
                results.append(request(srv.port, path=f"/{i}/{j}"))

        clients = [threading.Thread(target=client, args=(i,)) for i in range(20)]
        done = threading.Event()
        peak = [0]

        def sample() -> None:  # the server's threads: all but the clients and this one
            while not done.is_set():
                peak[0] = max(peak[0], new_threads(before, *clients, sampler))
                done.wait(0.001)

        sampler = threading.Thread(target=sample)
        sampler.start()
        for t in clients:
            t.start()
        for t in clients:
            t.join()
        done.set()
        sampler.join()
        assert len(results) == 100 and all(status == 200 for status, _ in results)
        assert 0 < peak[0] <= started and new_threads(before) == started
        for s in idle:
            s.close()
    finally:
        srv.stop()
    all_exited(before)


def refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=10).close()
    except ConnectionRefusedError:
        return True
    return False


def test_stop_is_clean_idempotent_and_frees_the_port() -> None:
    entered, release = threading.Event(), threading.Event()

    def slow(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        entered.set()
        release.wait(10)
        start_response("200 OK", [("Content-Length", "4")])
        return [b"done"]

    before = set(threading.enumerate())
    srv = HttpServer("127.0.0.1:0", slow, name="test", threads=2)
    srv.start()
    port = srv.port
    answer: list[tuple[int, bytes]] = []
    in_flight = threading.Thread(target=lambda: answer.append(request(port)))
    in_flight.start()
    assert entered.wait(10)
    stopper = threading.Thread(target=srv.stop)
    stopper.start()
    wait_for(lambda: refused(port), what="stop() to close the listening socket")
    release.set()  # only now may the running request finish
    stopper.join()
    in_flight.join()
    assert answer == [(200, b"done")]  # the request running at stop() was finished
    srv.stop()
    all_exited(before)
    assert refused(port)
    again = HttpServer(f"127.0.0.1:{port}", echo, name="test")
    again.start()  # the port is free at once (SO_REUSEADDR, no lingering listener)
    again.stop()


def test_stop_before_start_and_start_after_stop() -> None:
    srv = HttpServer("127.0.0.1:0", echo, name="test")
    srv.stop()
    with pytest.raises(RuntimeError):
        srv.start()
