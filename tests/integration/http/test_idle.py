"""The shared HTTP server closes idle connections itself, in real time (cheroot's
channel timeout has one-second resolution): a silent client and a kept-alive one."""

from __future__ import annotations

import http.client
import socket
from collections.abc import Iterable
from typing import Any

import pytest

from gpudaemon.httpserver import HttpServer

pytestmark = pytest.mark.integration


def echo(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
    out = environ["PATH_INFO"].encode()
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(out)))])
    return [out]


def test_idle_connections_are_closed_by_the_server() -> None:
    srv = HttpServer("127.0.0.1:0", echo, name="test", idle_timeout_s=1)
    srv.start()
    try:
        silent = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
        kept = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
        kept.request("GET", "/once")
        assert kept.getresponse().read() == b"/once"  # HTTP/1.1: the connection stays open
        assert kept.sock is not None
        # recv blocks until the server closes: b"" then, a time-out error if it never does.
        assert silent.recv(1) == b""
        assert kept.sock.recv(1) == b""
        silent.close()
        kept.close()
    finally:
        srv.stop()
