"""The extender's transport limits (issue 17) on real sockets: mutual TLS refuses any
caller without a client certificate from our CA at the handshake; headers and bodies
over their caps get a 4xx and the server stays up; the plain metrics address never
serves the scheduler verbs."""

from __future__ import annotations

import http.client
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpudaemon.extender.app import observability_only
from gpudaemon.httpserver import HttpServer, TlsFiles, TlsHttpServer, text_response
from tests.certs import Pki, make_pki
from tests.support import wait_for

pytestmark = pytest.mark.integration  # real sockets, real TLS handshakes


def app(environ: dict[str, object], start_response: object) -> list[bytes]:
    return text_response(start_response, "200 OK", f"ok {environ['PATH_INFO']}\n")  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def tls_server(pki: Pki) -> Iterator[TlsHttpServer]:
    srv = TlsHttpServer(
        "127.0.0.1:0",
        app,
        TlsFiles(pki.server.cert, pki.server.key, pki.ca),
        name="extender",
        max_body_bytes=4096,
        max_header_bytes=4096,
    )
    srv.start()
    yield srv
    srv.stop()


def client_ctx(pki: Pki, cert: tuple[str, str] | None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=pki.ca)
    if cert is not None:
        ctx.load_cert_chain(*cert)
    return ctx


def get(port: int, ctx: ssl.SSLContext, path: str = "/healthz", **kw: object) -> tuple[int, bytes]:
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=5)
    try:
        conn.request("GET", path, **kw)  # type: ignore[arg-type]
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def test_the_scheduler_s_client_certificate_is_let_in(tls_server: TlsHttpServer, pki: Pki) -> None:
    assert get(tls_server.port, client_ctx(pki, (pki.client.cert, pki.client.key))) == (
        200,
        b"ok /healthz\n",
    )


@pytest.mark.parametrize("who", ["no certificate", "a stranger's CA"])
def test_a_caller_without_our_client_certificate_is_refused_at_the_handshake(
    tls_server: TlsHttpServer, pki: Pki, who: str
) -> None:
    cert = None if who == "no certificate" else (pki.stranger.cert, pki.stranger.key)
    with pytest.raises((ssl.SSLError, ConnectionError, http.client.HTTPException)):
        get(tls_server.port, client_ctx(pki, cert))
    # and the server is still up for the scheduler
    assert get(tls_server.port, client_ctx(pki, (pki.client.cert, pki.client.key)))[0] == 200


def test_plain_http_to_the_tls_port_gets_no_answer_from_the_app(tls_server: TlsHttpServer) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", tls_server.port, timeout=5)
    try:
        conn.request("GET", "/healthz")
        r = conn.getresponse()
        assert r.status == 400 and b"ok" not in r.read()
    except (ConnectionError, http.client.HTTPException):
        pass
    finally:
        conn.close()


def test_oversized_headers_are_refused_and_the_tls_server_stays_up(
    tls_server: TlsHttpServer, pki: Pki
) -> None:
    ctx = client_ctx(pki, (pki.client.cert, pki.client.key))
    status, _ = get(tls_server.port, ctx, headers={"X-Big": "x" * 8000})
    assert 400 <= status < 500
    assert get(tls_server.port, ctx)[0] == 200


def test_oversized_headers_are_431_on_the_plain_server() -> None:
    srv = HttpServer("127.0.0.1:0", app, name="extender", max_header_bytes=4096)
    srv.start()
    try:
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"x" * 8000 + b"\r\n\r\n")
        assert s.recv(100).split(b"\r\n")[0].endswith(b" 431 Request Header Fields Too Large")
        s.close()
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=5)
        conn.request("GET", "/healthz")
        assert conn.getresponse().status == 200
        conn.close()
    finally:
        srv.stop()


def test_a_missing_certificate_file_is_one_line(tmp_path: Path, pki: Pki) -> None:
    from gpudaemon.errors import UsageError

    with pytest.raises(UsageError, match=r"^extender\.tls\.key_file .*missing"):
        TlsHttpServer(
            "127.0.0.1:0", app, TlsFiles(pki.server.cert, str(tmp_path / "missing"), pki.ca),
            name="extender",
        )  # fmt: skip


def test_the_metrics_address_never_serves_the_scheduler_verbs() -> None:
    wrapped = observability_only(app)
    got: list[str] = []
    for path in ("/filter", "/prioritize", "/metrics"):
        wrapped({"PATH_INFO": path}, lambda status, headers: got.append(status))
    assert got == ["404 Not Found", "404 Not Found", "200 OK"]


def test_a_stream_of_refused_handshakes_is_one_log_line_a_minute(
    tls_server: TlsHttpServer, pki: Pki, lines: list[tuple[str, str]]
) -> None:
    for _ in range(20):
        with pytest.raises((ssl.SSLError, ConnectionError, http.client.HTTPException)):
            get(tls_server.port, client_ctx(pki, None))
    # The refusals are counted, then logged, on the loop thread.
    wait_for(lambda: tls_server.refused >= 20, 10, what="the 20 refusals counted")
    refused = [m for _, m in lines if "extender:" in m and ("TLS" in m or "SSL" in m)]
    assert len(refused) == 1, refused


def test_silent_tcp_connections_delay_no_mutual_tls_caller(
    tls_server: TlsHttpServer, pki: Pki
) -> None:
    """Issue 28: the old server did each handshake on its accept thread, so one silent
    connection stalled every caller for its 30 s socket time-out."""
    silent = [socket.create_connection(("127.0.0.1", tls_server.port)) for _ in range(3)]
    try:
        time.sleep(0.3)  # the scenario: connections that have said nothing for a while
        ctx = client_ctx(pki, (pki.client.cert, pki.client.key))
        for _ in range(3):
            t0 = time.monotonic()
            assert get(tls_server.port, ctx)[0] == 200
            assert time.monotonic() - t0 < 1.0
    finally:
        for s in silent:
            s.close()


def test_a_handshake_that_never_comes_is_closed_at_the_read_time_out(pki: Pki) -> None:
    srv = TlsHttpServer(
        "127.0.0.1:0", app, TlsFiles(pki.server.cert, pki.server.key, pki.ca),
        name="extender", read_timeout_s=1,
    )  # fmt: skip
    srv.start()
    try:
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        s.sendall(b"\x16\x03\x01")  # the start of a ClientHello, then nothing
        t0 = time.monotonic()
        assert s.recv(1) == b""
        assert time.monotonic() - t0 < 4
        s.close()
    finally:
        srv.stop()
