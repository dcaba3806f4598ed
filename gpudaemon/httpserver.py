"""The one HTTP server behind the agent (:9445), the extender (:9446, :9448) and the
rebalancer (:9447), plain or mutual TLS.

waitress, chosen by measurement (bench/http, docs/benchmarks.md): one event-loop thread
owns every socket, so an idle keep-alive connection costs a file descriptor and no thread,
and a fixed pool of `threads` runs the WSGI app. TLS runs in memory on that same loop
(ssl.MemoryBIO), so a handshake never blocks anyone. Tuned here: listen backlog 1024,
a read time-out per request and an idle time-out between requests, shedding the stalest
connection at the connection limit, request bodies over `max_body_bytes` refused with
413 before they are read and bodies at once capped by a budget (503), poll() instead of
select() so that more than 1,024 sockets work, and request bodies (up to the limit) and
answers (up to 16 MiB) kept in memory: waitress would otherwise spill anything over
512 KiB / 1 MiB to a temp file. Why each limit: docs/security.md, *Slow and large
clients*.
"""

from __future__ import annotations

import errno
import logging
import math
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, cast

from loguru import logger
from waitress import wasyncore
from waitress.adjustments import Adjustments
from waitress.channel import HTTPChannel
from waitress.parser import HTTPRequestParser
from waitress.server import TcpWSGIServer
from waitress.task import ThreadedTaskDispatcher
from waitress.utilities import Error as WaitressError
from waitress.utilities import RequestEntityTooLarge

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
# A TLS client must finish its handshake this soon after connecting: a real one takes
# milliseconds; a silent or trickling one is only holding a connection slot.
HANDSHAKE_TIMEOUT_S = 5.0

# Under a burst the task queue is briefly deeper than the pool: that is the design, not
# something to warn about on every request. The connection-limit lines are ours now.
logging.getLogger("waitress.queue").setLevel(logging.ERROR)
logging.getLogger("waitress").setLevel(logging.ERROR)


class _ServerBusy(WaitressError):
    code = 503
    reason = "Service Unavailable"


class BodyBudget:
    """Request-body bytes held at once, across every connection of one server: a body
    is counted from its headers (by Content-Length, before any of it is read) until its
    request has been answered, so the parse it feeds counts too. Past the budget a
    request is refused at once with 503 rather than buffered (bench/bodies measures
    what each body byte costs in RSS)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        with self._lock:
            if self.held + n > self.limit:
                return False
            self.held += n
            return True

    def give(self, n: int) -> None:
        with self._lock:
            self.held -= n


class _Parser(HTTPRequestParser):
    """waitress's parser plus: when the time the request started (its read deadline),
    the body's share of the budget, and a 413 that names the setting."""

    def __init__(self, adj: Any, *, budget: BodyBudget, what: str, max_body: int) -> None:
        super().__init__(adj)
        self.started = time.time()
        self._budget = budget
        self._what = what
        self._max_body = max_body
        self._checked = False
        self._held = 0

    def received(self, data: bytes) -> int:
        n = int(super().received(data))
        if self.headers_finished and not self._checked:
            self._checked = True
            if isinstance(self.error, RequestEntityTooLarge):
                self.error = RequestEntityTooLarge(
                    f"the body ({self.content_length} bytes) is over {self._what}.max_body_bytes"
                    f" ({self._max_body}); refused before reading it"
                )
            elif self.error is None and not self.completed:
                # Chunked bodies have no length up front: they count at the cap.
                need = self.content_length if self.content_length > 0 else self._max_body
                if self._budget.take(need):
                    self._held = need
                else:
                    self.error = _ServerBusy(
                        f"{self._budget.held} bytes of request bodies are being served and"
                        f" this one ({need}) would pass {self._what}.body_budget_bytes"
                        f" ({self._budget.limit}); retry"
                    )
                    self.completed = True
        return n

    def close(self) -> None:
        if self._held:
            self._budget.give(self._held)
            self._held = 0
        super().close()


class _Channel(HTTPChannel):
    """waitress's channel plus the state the server's maintenance needs: how many
    requests it has answered (a connection that never finished one is a stranger) and
    whether it was closed by a time-out (closed even with output still queued)."""

    served = 0
    expired = False

    def __init__(self, server: Any, sock: socket.socket, addr: Any, adj: Any, map: Any = None):
        self.parser_class = server.make_parser
        super().__init__(server, sock, addr, adj, map)

    def service(self) -> None:
        try:
            super().service()
        finally:
            self.served += 1

    def expire(self) -> None:
        self.expired = True
        self.will_close = True

    def handshaken(self) -> bool:
        return True

    def handle_close(self) -> None:
        with cast(Any, self).requests_lock:
            if self.request is not None:  # a body cut off mid-way gives its budget back
                self.request.close()
                self.request = None
        super().handle_close()


class _TlsChannel(_Channel):
    """TLS in memory (ssl.MemoryBIO) on waitress's event loop: the handshake advances
    as bytes arrive, like every other read, so no thread ever waits on a client that
    connected and stayed silent, and the server's time-outs apply to it as they do to
    plain connections. The context requires a client certificate: without one from our
    CA the handshake fails and the connection closes before any byte reaches the app."""

    def __init__(self, server: Any, sock: socket.socket, addr: Any, adj: Any, map: Any = None):
        self._in = ssl.MemoryBIO()
        self._out = ssl.MemoryBIO()
        self._tls = server.ssl_context.wrap_bio(self._in, self._out, server_side=True)
        self._done = False
        self._raw = bytearray()  # ciphertext the socket has not taken yet
        super().__init__(server, sock, addr, adj, map)

    def handshaken(self) -> bool:
        return self._done

    def writable(self) -> bool:
        return bool(self._raw) or bool(super().writable())

    def handle_read(self) -> None:
        try:
            raw = cast(socket.socket, self.socket).recv(self.adj.recv_bytes)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.handle_close()
            return
        if not raw:
            self.handle_close()
            return
        self._in.write(raw)
        plain = []
        try:
            if not self._done:
                self._tls.do_handshake()
                self._done = True
            while True:
                plain.append(self._tls.read(1 << 16))
        except ssl.SSLWantReadError:
            pass
        except ssl.SSLZeroReturnError:  # the client's close_notify
            self.will_close = True
        except ssl.SSLError as e:
            cast(Any, self.server).refused(e)
            self._flush_raw()  # the alert, so the client learns why
            self.handle_close()
            return
        self._flush_raw()
        data = b"".join(plain)
        if data:
            self.last_activity = time.time()
            self.received(data)

    def send(self, data: bytes, do_close: bool = True) -> int:
        if self._raw:
            self._flush_raw(do_close)
            if self._raw:
                return 0
        try:
            n = int(self._tls.write(data))
        except ssl.SSLError:
            self.expire()
            return 0
        self._flush_raw(do_close)
        return n

    def _flush_raw(self, do_close: bool = True) -> None:
        self._raw += self._out.read()
        if not self._raw or self.socket is None:
            return
        try:
            sent = self.socket.send(self._raw)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._raw.clear()
            if do_close:
                self.handle_close()
            return
        del self._raw[:sent]

    def handle_write(self) -> None:
        # waitress's, except that "flushed" also means no ciphertext left to send: an
        # answer followed by a close (a 413, say) must reach the client whole.
        if self.expired:
            self.handle_close()
            return
        self._flush_raw()
        if self._raw:
            return
        me: Any = self  # (types-waitress leaves these out)
        if not self.requests:
            flush: Any = me._flush_some
        elif self.total_outbufs_len >= self.adj.send_bytes:
            flush = me._flush_some_if_lockable
        else:
            flush = None
        me._flush_exception(flush)
        if self._raw:
            return
        if self.close_when_flushed and not self.total_outbufs_len:
            self.close_when_flushed = False
            self.will_close = True
        if self.will_close:
            self.handle_close()


class _Server(TcpWSGIServer):
    """waitress's TCP server with the time-outs and the connection limit done our way:

    - a request must arrive whole (headers and body; for a new connection, its TLS
      handshake and first request) within `read_timeout_s` of its first byte, or of the
      connection opening: a client that trickles its headers is closed then;
    - a connection idle between requests is closed after `idle_timeout_s`;
    - at the connection limit, a waiting connection is taken in and the stalest
      connection that is not being served is closed for it, strangers (never finished a
      request) first: slow clients cannot keep the scheduler out. Only when every
      connection is mid-request does the server stop accepting (the backlog holds the
      rest)."""

    channel_class = _Channel
    read_timeout_s = 10.0
    idle_timeout_s = 30.0
    make_parser: Callable[[Any], _Parser]
    ssl_context: ssl.SSLContext | None = None
    refused: Callable[[BaseException], None]
    shed = 0  # connections closed to make room for a newer one

    def maintenance(self, now: float) -> None:
        for ch in list(self._channels().values()):
            if ch.requests or ch.will_close:
                continue
            if not ch.handshaken():
                late = now - ch.creation_time > min(HANDSHAKE_TIMEOUT_S, self.read_timeout_s)
            elif ch.request is not None:
                late = now - ch.request.started > self.read_timeout_s
            elif not ch.served:
                late = now - ch.creation_time > self.read_timeout_s
            else:
                late = now - ch.last_activity > self.idle_timeout_s
            if late:
                ch.expire()

    def readable(self) -> bool:
        now = time.time()
        if now >= self.next_channel_cleanup:
            self.next_channel_cleanup = now + self.adj.cleanup_interval  # type: ignore[assignment]
            self.maintenance(now)
        if not self.accepting:
            return False
        live = self._live()
        # At the limit, accept only if a connection can make room (handle_accept).
        return len(live) < self.adj.connection_limit or self._stalest(live) is not None

    def handle_accept(self) -> None:
        live = self._live()
        victim = self._stalest(live) if len(live) >= self.adj.connection_limit else None
        before = len(self._channels())
        super().handle_accept()
        if victim is not None and len(self._channels()) > before:
            victim.expire()
            self.shed += 1

    def _channels(self) -> dict[int, Any]:
        return cast(dict[int, Any], self.active_channels)

    def _live(self) -> list[Any]:
        return [c for c in self._channels().values() if not c.will_close]

    @staticmethod
    def _stalest(live: list[Any]) -> Any:
        strangers = [c for c in live if not c.served and not c.requests]
        if strangers:
            return min(strangers, key=lambda c: c.creation_time)
        idle = [c for c in live if not c.requests and c.request is None]
        return min(idle, key=lambda c: c.last_activity) if idle else None


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
    concurrent app calls; connections are bounded separately by `max_connections` (at
    it, the stalest connection not being served makes room, see `_Server`). Time-outs
    have one-second resolution: `read_timeout_s` for a request to arrive whole (headers
    and body, and a new connection's TLS handshake), `idle_timeout_s` between requests.
    Bodies over `max_body_bytes` are refused with 413 by their Content-Length before
    any of the body is read; bodies held at once are capped by `body_budget_bytes`
    (503 past it; default: room for `threads` bodies at the cap). `tls`: mutual TLS,
    a client certificate from `tls.client_ca_file` required (the extender's service
    mode)."""

    def __init__(
        self,
        listen: str | tuple[str, int],
        app: WsgiApp,
        *,
        name: str,
        threads: int = 8,
        idle_timeout_s: float = 30.0,
        read_timeout_s: float = 10.0,
        max_body_bytes: int = 1 << 20,
        body_budget_bytes: int | None = None,
        max_connections: int = 1000,
        max_header_bytes: int = 64 << 10,
        grace_s: float = 5.0,
        tls: TlsFiles | None = None,
    ) -> None:
        self.name = name
        self.listen = listen if isinstance(listen, str) else f"{listen[0]}:{listen[1]}"
        self._what = f"{name}.listen"
        self._host, self._port = parse_listen(listen, self._what)
        budget = threads * max_body_bytes if body_budget_bytes is None else body_budget_bytes
        if (
            threads < 1
            or max_connections < 1
            or max_body_bytes < 0
            or idle_timeout_s <= 0
            or read_timeout_s <= 0
            or budget < max_body_bytes
        ):
            raise UsageError(
                f"{name}: threads and max_connections must be >= 1, max_body_bytes >= 0,"
                " body_budget_bytes >= max_body_bytes and the time-outs > 0"
            )
        self.app = app
        self._threads = threads
        self._idle_s = max(1, math.ceil(idle_timeout_s))
        self._read_s = max(1, math.ceil(read_timeout_s))
        self._max_body = max_body_bytes
        self.budget = BodyBudget(budget)
        self._max_conns = max_connections
        self._max_header = max_header_bytes
        self._grace_s = grace_s
        self._ssl = _server_context(tls, name) if tls is not None else None
        # A stranger can fail handshakes in a loop: one line a minute, not one each.
        self._refusals = LogLimiter(60.0)
        self.refused = 0
        self._map: dict[int, Any] = {}
        self._server: _Server | None = None
        self._loop: threading.Thread | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._stopped = False
        self.port = self._port

    def _refused(self, e: BaseException) -> None:
        self.refused += 1
        if self._refusals.allow("handshake"):
            logger.warning(
                "{}: refused a TLS handshake: {} (at most one such line a minute)",
                self.name,
                getattr(e, "reason", None) or e,
            )

    def _make_parser(self, adj: Any) -> _Parser:
        return _Parser(adj, budget=self.budget, what=self.name, max_body=self._max_body)

    @property
    def shed(self) -> int:
        """Connections closed to make room at the connection limit."""
        return self._server.shed if self._server is not None else 0

    def start(self) -> None:
        with self._lock:
            if self._server is not None or self._stopped:
                raise RuntimeError(f"{self.name}: HttpServer.start() called twice")
            sock = _bind(self._host, self._port, self.listen, self._what)
            self.port = sock.getsockname()[1]
            adj = Adjustments(
                sockets=[sock],
                threads=self._threads,
                backlog=BACKLOG,
                connection_limit=self._max_conns,
                channel_timeout=self._idle_s,
                cleanup_interval=1,  # the time-outs are checked every second
                max_request_body_size=self._max_body + 1,  # waitress refuses ">= limit"
                max_request_header_size=self._max_header,  # over it: 431
                inbuf_overflow=max(self._max_body, 1 << 19),
                asyncore_use_poll=True,
                recv_bytes=1 << 16,  # 8 KiB by default: a 1 MiB body took 128 loop turns
                outbuf_overflow=1 << 24,  # answers up to 16 MiB stay in memory
                clear_untrusted_proxy_headers=False,
                url_scheme="https" if self._ssl is not None else "http",
                ident="gpudaemon",
            )
            dispatcher = ThreadedTaskDispatcher()
            dispatcher.set_thread_count(self._threads)
            server = _Server(
                self.app,
                self._map,
                True,
                sock,
                dispatcher=dispatcher,
                adj=adj,
                bind_socket=False,
                sockinfo=(sock.family, sock.type, sock.proto, sock.getsockname()),
            )
            server.read_timeout_s = self._read_s
            server.idle_timeout_s = self._idle_s
            server.make_parser = self._make_parser
            server.refused = self._refused
            if self._ssl is not None:
                server.ssl_context = self._ssl
                server.channel_class = _TlsChannel
            self._server = server
            self._loop = threading.Thread(target=self._run, name=f"{self.name}-http", daemon=True)
            self._loop.start()

    def _run(self) -> None:
        while not self._stopping.is_set():
            wasyncore.loop(timeout=_LOOP_TICK_S, map=self._map, use_poll=True, count=1)
        # Stopping: flush what finished requests wrote, briefly, then close every socket.
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and any(
            isinstance(c, HTTPChannel) and c.writable() and not c.will_close
            for c in list(self._map.values())
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


def _server_context(tls: TlsFiles, name: str) -> ssl.SSLContext:
    for what, path in (
        ("tls.cert_file", tls.cert_file),
        ("tls.key_file", tls.key_file),
        ("tls.client_ca_file", tls.client_ca_file),
    ):
        check_regular_file(path, f"{name}.{what}", 1 << 20)
    try:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(tls.cert_file, tls.key_file)
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(cafile=tls.client_ca_file)
    except (ssl.SSLError, OSError, ValueError) as e:
        raise UsageError(f"{name}.tls: cannot load the certificates: {e}") from None
    return ctx


class TlsHttpServer(HttpServer):
    """The extender's server when it runs apart from kube-scheduler (service mode): TLS
    with a client certificate required, so any caller without one is refused at the
    handshake and never reaches the app. The same server as `HttpServer` (one event
    loop, the same limits and time-outs): TLS runs in memory on that loop, so a silent
    TCP connection holds no thread and delays no one (it was cheroot's accept thread,
    which did each handshake in turn: one idle connection stalled every caller 30 s)."""

    def __init__(
        self, listen: str | tuple[str, int], app: WsgiApp, tls: TlsFiles, **kw: Any
    ) -> None:
        super().__init__(listen, app, tls=tls, **kw)
