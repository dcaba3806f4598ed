"""HttpServer: bind (one line on failure), serve on waitress's loop in background
threads, stop gracefully; TlsHttpServer, the same with mutual TLS."""

from __future__ import annotations

import contextlib
import math
import threading
import time
from typing import Any

from loguru import logger
from waitress import wasyncore
from waitress.adjustments import Adjustments
from waitress.channel import HTTPChannel
from waitress.task import ThreadedTaskDispatcher

from gpudaemon.errors import UsageError
from gpudaemon.httpserver.limits import BodyBudget, _Parser, _Server
from gpudaemon.httpserver.listen import BACKLOG, _bind, parse_listen
from gpudaemon.httpserver.responses import WsgiApp
from gpudaemon.httpserver.tls import TlsFiles, _server_context, _TlsChannel
from gpudaemon.logsetup import LogLimiter

_LOOP_TICK_S = 1.0  # how long the loop may sleep; stop() wakes it at once anyway


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
        # Wake the loop to see `_stopping`. It may have seen it already and closed the
        # trigger on its way out (EBADF): then there is nothing left to wake.
        with contextlib.suppress(OSError):
            trigger.pull_trigger()
        loop.join(self._grace_s + 2.0)


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
