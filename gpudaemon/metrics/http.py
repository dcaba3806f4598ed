"""The agent's HTTP endpoints: /metrics (prometheus-client's WSGI app, which handles
OpenMetrics and gzip negotiation), /healthz and /readyz."""

from __future__ import annotations

import gzip
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import choose_encoder

from gpudaemon.errors import UsageError
from gpudaemon.metrics.collector import GpuCollector, without_gpus

StartResponse = Callable[..., Any]
Readiness = Callable[[], tuple[bool, str]]


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def make_app(
    registry: CollectorRegistry, ready: Readiness, gpus: GpuCollector | None = None
) -> Callable[..., Iterable[bytes]]:
    """With `gpus` (registered in `registry`), /metrics appends that collector's cached
    per-snapshot bytes instead of re-encoding every GPU series on every scrape."""
    metrics = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/")
        if path == "/metrics":
            if gpus is None or environ.get("QUERY_STRING"):  # name[] filters: the slow path
                return metrics(environ, start_response)  # type: ignore[no-any-return]
            return _fast_metrics(registry, gpus, environ, start_response)
        if path == "/healthz":
            return _text(start_response, "200 OK", "ok\n")
        if path == "/readyz":
            ok, why = ready()
            return _text(start_response, "200 OK" if ok else "503 Service Unavailable", why + "\n")
        return _text(
            start_response, "404 Not Found", "not found: try /metrics, /healthz, /readyz\n"
        )

    return app


def _fast_metrics(
    registry: CollectorRegistry,
    gpus: GpuCollector,
    environ: dict[str, Any],
    start_response: StartResponse,
) -> list[bytes]:
    encoder, content_type = choose_encoder(environ.get("HTTP_ACCEPT", ""))
    openmetrics = content_type.startswith("application/openmetrics-text")
    with without_gpus():
        head = encoder(registry)
    gpu_part = gpus.render_gpus(openmetrics)
    # OpenMetrics ends with "# EOF": the GPU families go before it.
    body = head.removesuffix(b"# EOF\n") + gpu_part + (b"# EOF\n" if openmetrics else b"")
    headers = [("Content-Type", content_type)]
    if "gzip" in environ.get("HTTP_ACCEPT_ENCODING", ""):
        body = gzip.compress(body)
        headers.append(("Content-Encoding", "gzip"))
    headers.append(("Content-Length", str(len(body))))
    start_response("200 OK", headers)
    return [body]


def _text(start_response: StartResponse, status: str, body: str) -> list[bytes]:
    data = body.encode()
    start_response(
        status, [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(data)))]
    )
    return [data]


class HttpServer:
    """Serves in a daemon thread; stop() closes the socket."""

    def __init__(self, listen: str, app: Callable[..., Iterable[bytes]]) -> None:
        host, _, port = listen.rpartition(":")
        try:
            self._server = make_server(
                host.strip("[]") or "0.0.0.0",
                int(port),
                app,
                server_class=_ThreadingServer,
                handler_class=_QuietHandler,
            )
        except OSError as e:  # address in use, unknown host, not an address of this host
            reason = e.strerror or str(e)
            raise UsageError(f"metrics.listen: cannot listen on {listen}: {reason}") from None
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            name="http",
            kwargs={"poll_interval": 0.2},
            daemon=True,
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
