"""The agent's HTTP endpoints: /metrics (prometheus-client's WSGI app, which handles
OpenMetrics and gzip negotiation), /healthz and /readyz, served by the shared
gpudaemon.httpserver."""

from __future__ import annotations

import gzip
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast
from urllib.parse import parse_qs

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import Metric
from prometheus_client.exposition import choose_encoder

from gpudaemon import httpserver
from gpudaemon.agent.metrics.collector import GpuCollector
from gpudaemon.httpserver import Readiness, StartResponse, probe_response, text_response


def make_app(
    registry: CollectorRegistry,
    ready: Readiness,
    gpus: GpuCollector | None = None,
    head: CollectorRegistry | None = None,
) -> Callable[..., Iterable[bytes]]:
    """`registry` holds every series. With `gpus` and `head` (every series but the
    GPU collector's), /metrics encodes `head` and appends the GPU collector's cached
    per-snapshot bytes instead of re-encoding every GPU series on every scrape."""
    metrics = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/")
        if path == "/metrics":
            names = parse_qs(environ.get("QUERY_STRING", "")).get("name[]")
            if names and environ.get("REQUEST_METHOD", "GET") == "GET":
                return _filtered_metrics(registry, set(names), environ, start_response)
            if gpus is None or head is None or environ.get("QUERY_STRING"):
                return metrics(environ, start_response)  # type: ignore[no-any-return]
            return _fast_metrics(head, gpus, environ, start_response)
        probe = probe_response(path, ready, start_response)
        if probe is not None:
            return probe
        return text_response(
            start_response, "404 Not Found", "not found: try /metrics, /healthz, /readyz\n"
        )

    return app


def _fast_metrics(
    head: CollectorRegistry,
    gpus: GpuCollector,
    environ: dict[str, Any],
    start_response: StartResponse,
) -> list[bytes]:
    encoder, content_type = choose_encoder(environ.get("HTTP_ACCEPT", ""))
    openmetrics = content_type.startswith("application/openmetrics-text")
    gpu_part = gpus.render_gpus(openmetrics)
    # OpenMetrics ends with "# EOF": the GPU families go before it.
    body = encoder(head).removesuffix(b"# EOF\n") + gpu_part + (b"# EOF\n" if openmetrics else b"")
    return _send_metrics(body, content_type, environ, start_response)


def _send_metrics(
    body: bytes, content_type: str, environ: dict[str, Any], start_response: StartResponse
) -> list[bytes]:
    headers = [("Content-Type", content_type)]
    if "gzip" in environ.get("HTTP_ACCEPT_ENCODING", ""):
        body = gzip.compress(body)
        headers.append(("Content-Encoding", "gzip"))
    headers.append(("Content-Length", str(len(body))))
    start_response("200 OK", headers)
    return [body]


class _Restricted:
    """`?name[]=` filtering over every family the registry collects. prometheus-client's
    restricted registry finds collectors by their describe() names, so it returned
    nothing for collectors that cannot describe themselves up front (the GPU collector,
    a registry inside a registry): issue 12, item 15. Same rule as prometheus-client:
    a family keeps the samples whose name was asked for."""

    def __init__(self, registry: CollectorRegistry, names: set[str]) -> None:
        self.registry, self.names = registry, names

    def collect(self) -> Iterator[Metric]:
        for fam in self.registry.collect():
            samples = [s for s in fam.samples if s.name in self.names]
            if samples:
                out = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                out.samples = samples
                yield out


def _filtered_metrics(
    registry: CollectorRegistry,
    names: set[str],
    environ: dict[str, Any],
    start_response: StartResponse,
) -> list[bytes]:
    encoder, content_type = choose_encoder(environ.get("HTTP_ACCEPT", ""))
    body = encoder(cast(CollectorRegistry, _Restricted(registry, names)))
    return _send_metrics(body, content_type, environ, start_response)


class HttpServer(httpserver.HttpServer):
    """The agent's server: the shared `gpudaemon.httpserver.HttpServer` with the agent's
    name ("metrics.listen: ..." in errors) and a small pool, since Prometheus scrapes are
    few and each takes about a millisecond."""

    def __init__(
        self, listen: str, app: Callable[..., Iterable[bytes]], *, name: str = "metrics"
    ) -> None:
        super().__init__(listen, app, name=name, threads=4, idle_timeout_s=60.0)
