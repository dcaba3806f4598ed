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

Modules: `server.py` (HttpServer: bind, serve, stop), `limits.py` (the time-outs, the
connection limit and the body budget on waitress's loop), `tls.py` (mutual TLS in memory
on that loop), `listen.py` (the listen-address parser the config shares),
`responses.py` (the probe and plain-text answers) and `exposition.py` (/metrics, with
a fast path for the biggest families).
"""

from gpudaemon.httpserver.limits import HANDSHAKE_TIMEOUT_S, BodyBudget
from gpudaemon.httpserver.listen import BACKLOG, parse_listen
from gpudaemon.httpserver.responses import (
    Readiness,
    StartResponse,
    WsgiApp,
    probe_response,
    text_response,
)
from gpudaemon.httpserver.server import HttpServer, TlsHttpServer
from gpudaemon.httpserver.tls import TlsFiles

__all__ = [
    "BACKLOG",
    "HANDSHAKE_TIMEOUT_S",
    "BodyBudget",
    "HttpServer",
    "Readiness",
    "StartResponse",
    "TlsFiles",
    "TlsHttpServer",
    "WsgiApp",
    "parse_listen",
    "probe_response",
    "text_response",
]
