"""The server's defences against slow and large clients, on waitress's event loop: the
read and idle time-outs, the connection limit (the stalest connection makes room), and
the request-body cap and budget. Why each limit: docs/security.md, *Slow and large
clients*."""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any, cast

from waitress.channel import HTTPChannel
from waitress.parser import HTTPRequestParser
from waitress.server import TcpWSGIServer
from waitress.utilities import Error as WaitressError
from waitress.utilities import RequestEntityTooLarge

# A TLS client must finish its handshake this soon after connecting: a real one takes
# milliseconds; a silent or trickling one is only holding a connection slot.
HANDSHAKE_TIMEOUT_S = 5.0
# A new connection still silent, or a request still arriving, this long after it began
# is slow, whatever the connection served before: at the connection limit it makes room
# for a newcomer. A scheduler's /filter arrives whole in milliseconds (a MiB in well
# under a second on any cluster network); a busy loop may take a while to read a new
# connection's first bytes, so a younger one is never cut off.
SLOW_REQUEST_S = 1.0

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
    """waitress's parser plus: the body's share of the budget, and a 413 that names
    the setting."""

    def __init__(self, adj: Any, *, budget: BodyBudget, what: str, max_body: int) -> None:
        super().__init__(adj)
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
    requests it has answered (a connection that never finished one is a stranger),
    since when its next request has been arriving, and whether it was closed by a
    time-out (closed even with output still queued)."""

    served = 0
    expired = False
    # Wall time of the first byte of the request now arriving; None between requests.
    # Set on the channel, not the parser: waitress starts a new parser after each
    # empty request (a blank line), so a client streaming blank lines would otherwise
    # look like a request that began a moment ago, for ever.
    pending_since: float | None = None

    def __init__(self, server: Any, sock: socket.socket, addr: Any, adj: Any, map: Any = None):
        self.parser_class = server.make_parser
        super().__init__(server, sock, addr, adj, map)

    def received(self, data: bytes) -> bool:
        if data and self.pending_since is None:
            self.pending_since = time.time()
        return bool(super().received(data))

    def service(self) -> None:
        try:
            super().service()
        finally:
            self.served += 1
            # The next request's clock starts with its first byte; one already partly
            # read (pipelined) started arriving by now at the latest.
            self.pending_since = time.time() if self.request is not None else None

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


class _Server(TcpWSGIServer):
    """waitress's TCP server with the time-outs and the connection limit done our way:

    - a request must arrive whole (headers and body; for a new connection, its TLS
      handshake and first request) within `read_timeout_s` of its first byte, or of the
      connection opening: a client that trickles its headers is closed then;
    - a connection idle between requests is closed after `idle_timeout_s`;
    - at the connection limit, a waiting connection is taken in and the stalest
      connection that is not being served is closed for it: strangers silent for over
      `SLOW_REQUEST_S` first, then connections whose request has been arriving for
      over `SLOW_REQUEST_S` (whether or not they were served before: one good request
      does not earn a trickling client its slot), then served connections idle
      between requests. A stranger whose bytes wait unread has spoken: it is never
      shed for the loop's own delay. Slow clients cannot
      keep the scheduler out, and a request arriving at normal speed is never cut off.
      Only when every connection is being served or younger than that in its silence
      or its request does the server stop accepting (the backlog holds the rest)."""

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
            elif ch.pending_since is not None:
                late = now - ch.pending_since > self.read_timeout_s
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
        return len(live) < self.adj.connection_limit or self._stalest(live, now) is not None

    def handle_accept(self) -> None:
        live = self._live()
        full = len(live) >= self.adj.connection_limit
        victim = self._stalest(live, time.time()) if full else None
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
    def _stalest(live: list[Any], now: float) -> Any:
        silent = [c for c in live if not c.served and not c.requests and c.pending_since is None
                  and now - c.creation_time > SLOW_REQUEST_S]  # fmt: skip
        # Strangers that have not begun a request (or a TLS handshake), oldest first. One
        # whose bytes wait unread in its socket has spoken: the loop is behind, not the
        # client, and a busy loop must not cut off the scheduler's new connection.
        for c in sorted(silent, key=lambda c: c.creation_time):
            if not _unread(c):
                return c
        slow = [c for c in live if not c.requests and c.pending_since is not None
                and now - c.pending_since > SLOW_REQUEST_S]  # fmt: skip
        if slow:
            return min(slow, key=lambda c: c.pending_since)
        # Served connections between requests; a stranger under the slow mark, or one
        # whose request waits unread, is never cut off.
        idle = [c for c in live if c.served and not c.requests and c.pending_since is None]
        return min(idle, key=lambda c: c.last_activity) if idle else None


def _unread(channel: Any) -> bool:
    """Whether bytes from the client wait in the channel's socket. The plain socket's
    recv is called even on a TLS socket, so that ciphertext counts and nothing is
    consumed."""
    sock = channel.socket
    if sock is None:
        return False
    try:
        return bool(socket.socket.recv(sock, 1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except OSError:  # nothing to read yet (BlockingIOError), or the socket is gone
        return False
