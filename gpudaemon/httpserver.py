"""The one HTTP server behind the agent (:9445) and the extender (:9446).

waitress, chosen by measurement (bench/http, docs/benchmarks.md): one event-loop thread
owns every socket, so an idle keep-alive connection costs a file descriptor and no thread,
and a fixed pool of `threads` runs the WSGI app. The stdlib servers hold a thread per
connection (unbounded, or a bounded pool that idle connections can starve). Tuned here:
listen backlog 1024 (Python's default is 5), idle connections closed after
`idle_timeout_s`, request bodies over `max_body_bytes` refused with 413 before they are
read, poll() instead of select() so that more than 1,024 sockets work, and request bodies
(up to the limit) and answers (up to 16 MiB) kept in memory: waitress would otherwise
spill anything over 512 KiB / 1 MiB to a temp file.
"""

from __future__ import annotations

import errno
import logging
import math
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from loguru import logger
from waitress import wasyncore
from waitress.channel import HTTPChannel
from waitress.server import BaseWSGIServer, create_server

from gpudaemon.errors import UsageError
from gpudaemon.logsetup import LogLimiter
from gpudaemon.textfile import check_regular_file

WsgiApp = Callable[..., Iterable[bytes]]
StartResponse = Callable[..., Any]
Readiness = Callable[[], tuple[bool, str]]


def text_response(start_response: StartResponse, status: str, body: str) -> list[bytes]:
    data = body.encode()
    start_response(
        status, [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(data)))]
    )
    return [data]


def probe_response(
    path: str, ready: Readiness, start_response: StartResponse
) -> list[bytes] | None:
    """/healthz (alive: always 200) and /readyz (the program's own readiness, 503 with
    the reason until ready), the same for the agent and the extender; None otherwise."""
    if path == "/healthz":
        return text_response(start_response, "200 OK", "ok\n")
    if path == "/readyz":
        ok, why = ready()
        return text_response(
            start_response, "200 OK" if ok else "503 Service Unavailable", why + "\n"
        )
    return None


BACKLOG = 1024
_LOOP_TICK_S = 1.0  # how long the loop may sleep; stop() wakes it at once anyway

# Under a burst the task queue is briefly deeper than the pool: that is the design, not
# something to warn about on every request.
logging.getLogger("waitress.queue").setLevel(logging.ERROR)


def parse_listen(listen: str | tuple[str, int], what: str) -> tuple[str, int]:
    """Accepts "host:port", "[v6]:port", ":port" (all IPv4 addresses) or (host, port)."""
    if isinstance(listen, tuple):
        host, port_text = listen[0], str(listen[1])
    else:
        text = listen.strip()
        if text.startswith("["):
            host, sep, rest = text[1:].partition("]")
            if not sep or not rest.startswith(":"):
                raise UsageError(f"{what}: {listen!r} is not [ipv6-address]:port")
            port_text = rest[1:]
        else:
            host, sep, port_text = text.rpartition(":")
            if not sep:
                raise UsageError(f"{what}: {listen!r} has no port (expected host:port)")
            if ":" in host:
                raise UsageError(f"{what}: {listen!r}: write an IPv6 address as [addr]:port")
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise UsageError(f"{what}: {listen!r}: port must be a number from 0 to 65535")
    return host or "0.0.0.0", int(port_text)


def _bind(host: str, port: int, listen: str, what: str) -> socket.socket:
    try:
        infos = socket.getaddrinfo(
            host, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE
        )
        # A name with both (localhost) binds its IPv4 address, as the stdlib server did;
        # "[::]:port" listens on both families (Linux's default bindv6only=0).
        family, kind, proto, _, addr = min(infos, key=lambda i: i[0] != socket.AF_INET)
    except (socket.gaierror, UnicodeError) as e:
        reason = e.strerror if isinstance(e, socket.gaierror) else str(e)
        raise UsageError(f"{what}: cannot listen on {listen}: {reason}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(BACKLOG)
    except OSError as e:  # address in use, not an address of this host, permission
        sock.close()
        reason = e.strerror or str(e)
        if e.errno == errno.EADDRINUSE:
            reason += " (another process is listening there)"
        raise UsageError(f"{what}: cannot listen on {listen}: {reason}") from None
    return sock


class HttpServer:
    """`start()` binds (UsageError with one line on failure) and serves in background
    threads; `port` is the bound port (so port 0 works); `stop()` is idempotent: it stops
    accepting, lets running requests finish (up to `grace_s`), then closes everything.

    `name` is the config section ("metrics", "extender"): it prefixes error messages
    ("metrics.listen: cannot listen on ...") and names the loop thread. `threads` bounds
    concurrent app calls; connections are bounded separately by `max_connections` (past
    it, new ones wait in the backlog). `idle_timeout_s` has one-second resolution."""

    def __init__(
        self,
        listen: str | tuple[str, int],
        app: WsgiApp,
        *,
        name: str,
        threads: int = 8,
        idle_timeout_s: float = 30.0,
        max_body_bytes: int = 1 << 20,
        max_connections: int = 1000,
        max_header_bytes: int = 64 << 10,
        grace_s: float = 5.0,
    ) -> None:
        self.name = name
        self.listen = listen if isinstance(listen, str) else f"{listen[0]}:{listen[1]}"
        self._what = f"{name}.listen"
        self._host, self._port = parse_listen(listen, self._what)
        if threads < 1 or max_connections < 1 or max_body_bytes < 0 or idle_timeout_s <= 0:
            raise UsageError(
                f"{name}: threads and max_connections must be >= 1, max_body_bytes >= 0 "
                "and idle_timeout_s > 0"
            )
        self.app = app
        self._threads = threads
        self._idle_s = max(1, math.ceil(idle_timeout_s))
        self._max_body = max_body_bytes
        self._max_conns = max_connections
        self._max_header = max_header_bytes
        self._grace_s = grace_s
        self._map: dict[int, Any] = {}
        self._server: BaseWSGIServer | None = None
        self._loop: threading.Thread | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._stopped = False
        self.port = self._port

    def start(self) -> None:
        with self._lock:
            if self._server is not None or self._stopped:
                raise RuntimeError(f"{self.name}: HttpServer.start() called twice")
            sock = _bind(self._host, self._port, self.listen, self._what)
            self.port = sock.getsockname()[1]
            server = create_server(
                self.app,
                map=self._map,
                sockets=[sock],
                threads=self._threads,
                backlog=BACKLOG,
                connection_limit=self._max_conns,
                channel_timeout=self._idle_s,
                cleanup_interval=max(1, self._idle_s // 2),
                max_request_body_size=self._max_body + 1,  # waitress refuses ">= limit"
                max_request_header_size=self._max_header,  # over it: 431
                inbuf_overflow=max(self._max_body, 1 << 19),
                asyncore_use_poll=True,
                recv_bytes=1 << 16,  # 8 KiB by default: a 1 MiB body took 128 loop turns
                outbuf_overflow=1 << 24,  # answers up to 16 MiB stay in memory
                clear_untrusted_proxy_headers=False,
                ident="gpudaemon",
            )
            assert isinstance(server, BaseWSGIServer)  # one socket: never a MultiSocketServer
            self._server = server
            self._loop = threading.Thread(target=self._run, name=f"{self.name}-http", daemon=True)
            self._loop.start()

    def _run(self) -> None:
        while not self._stopping.is_set():
            wasyncore.loop(timeout=_LOOP_TICK_S, map=self._map, use_poll=True, count=1)
        # Stopping: flush what finished requests wrote, briefly, then close every socket.
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and any(
            isinstance(c, HTTPChannel) and c.total_outbufs_len for c in list(self._map.values())
        ):
            wasyncore.loop(timeout=0.05, map=self._map, use_poll=True, count=1)
        wasyncore.close_all(self._map, ignore_all=True)

    def stop(self) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            server, loop = self._server, self._loop
        if server is None or loop is None:
            return
        trigger: Any = server.trigger  # (types-waitress declares it an int)
        stopped_accepting = threading.Event()

        def stop_accepting() -> None:  # runs on the loop thread, which owns the sockets
            wasyncore.dispatcher.close(server)
            for channel in list(self._map.values()):
                if isinstance(channel, HTTPChannel) and not channel.requests:
                    channel.close()
            stopped_accepting.set()

        trigger.pull_trigger(stop_accepting)
        stopped_accepting.wait(self._grace_s)
        # Running requests finish; queued ones are cancelled (their connections close).
        server.task_dispatcher.shutdown(cancel_pending=True, timeout=math.ceil(self._grace_s))
        self._stopping.set()
        trigger.pull_trigger()
        loop.join(self._grace_s + 2.0)


@dataclass(frozen=True)
class TlsFiles:
    """Server certificate and key, and the CA that client certificates must chain to."""

    cert_file: str
    key_file: str
    client_ca_file: str


class TlsHttpServer:
    """The extender's server when it runs apart from kube-scheduler (Service mode): TLS
    with a client certificate required, so any caller without one is refused at the
    handshake and never reaches the app.

    cheroot (CherryPy's WSGI server), because waitress has no TLS. Same interface and
    limits as `HttpServer`: `threads` app calls at once, bodies over `max_body_bytes`
    refused (413), headers over `max_header_bytes` refused."""

    def __init__(
        self,
        listen: str | tuple[str, int],
        app: WsgiApp,
        tls: TlsFiles,
        *,
        name: str,
        threads: int = 8,
        idle_timeout_s: float = 30.0,
        max_body_bytes: int = 1 << 20,
        max_connections: int = 1000,
        max_header_bytes: int = 64 << 10,
        grace_s: float = 5.0,
    ) -> None:
        import ssl

        from cheroot import wsgi
        from cheroot.ssl.builtin import BuiltinSSLAdapter

        self.name = name
        self.listen = listen if isinstance(listen, str) else f"{listen[0]}:{listen[1]}"
        self._what = f"{name}.listen"
        host, port = parse_listen(listen, self._what)
        for what, path in (
            ("tls.cert_file", tls.cert_file),
            ("tls.key_file", tls.key_file),
            ("tls.client_ca_file", tls.client_ca_file),
        ):
            check_regular_file(path, f"{name}.{what}", 1 << 20)
        try:
            adapter = BuiltinSSLAdapter(tls.cert_file, tls.key_file)
            adapter.context.verify_mode = ssl.CERT_REQUIRED
            adapter.context.load_verify_locations(cafile=tls.client_ca_file)
            adapter.context.minimum_version = ssl.TLSVersion.TLSv1_2
        except (ssl.SSLError, OSError, ValueError) as e:
            raise UsageError(f"{name}.tls: cannot load the certificates: {e}") from None
        self._server = wsgi.Server(
            (host, port),
            app,
            numthreads=threads,
            max=threads,
            request_queue_size=min(BACKLOG, max_connections),
            timeout=max(1, math.ceil(idle_timeout_s)),
            shutdown_timeout=max(1, math.ceil(grace_s)),
        )
        self._server.ssl_adapter = adapter
        # cheroot writes a line to stderr for every refused handshake: a stranger
        # could fill the log. Counted instead, one line a minute per kind.
        self._refusals = LogLimiter(60.0)
        self._server.error_log = self._error_log  # type: ignore[method-assign]
        self._server.max_request_body_size = max_body_bytes
        self._server.max_request_header_size = max_header_bytes
        self._thread: threading.Thread | None = None
        self._stopped = False
        self.port = port

    def _error_log(self, msg: str = "", level: int = 20, traceback: bool = False) -> None:
        text = str(msg).split("\n")[0]
        kind = "handshake" if "TLS" in text or "SSL" in text else text[:40]
        if self._refusals.allow(kind):
            logger.warning("{}: {} (at most one such line a minute)", self.name, text)

    def start(self) -> None:
        try:
            self._server.prepare()
        except OSError as e:
            raise UsageError(f"{self._what}: cannot listen on {self.listen}: {e}") from None
        bound = self._server.bind_addr
        if isinstance(bound, tuple):
            self.port = int(bound[1])
        self._thread = threading.Thread(
            target=self._server.serve, name=f"{self.name}-https", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        if self._stopped or self._thread is None:
            return
        self._stopped = True
        self._server.stop()
        self._thread.join(10.0)
