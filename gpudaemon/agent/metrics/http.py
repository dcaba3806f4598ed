"""The agent's HTTP endpoints: /metrics (prometheus-client's WSGI app, which handles
OpenMetrics and gzip negotiation), /healthz and /readyz, served by the shared
gpudaemon.httpserver."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry

from gpudaemon import httpserver
from gpudaemon.agent.metrics.collector import GpuCollector
from gpudaemon.httpserver import Readiness
from gpudaemon.kube.runner import observability_app


def make_app(
    registry: CollectorRegistry,
    ready: Readiness,
    gpus: GpuCollector | None = None,
    head: CollectorRegistry | None = None,
) -> Callable[..., Iterable[bytes]]:
    """`registry` holds every series. With `gpus` and `head` (every series but the
    GPU collector's), /metrics encodes `head` and appends the GPU collector's cached
    per-snapshot bytes instead of re-encoding every GPU series on every scrape. The
    routes are the extender's and the rebalancer's (kube/runner.py)."""
    render = gpus.render_gpus if gpus is not None else None
    return observability_app(registry, ready, head=head, render=render)


class HttpServer(httpserver.HttpServer):
    """The agent's server: the shared `gpudaemon.httpserver.HttpServer` with the agent's
    name ("metrics.listen: ..." in errors) and a small pool, since Prometheus scrapes are
    few and each takes about a millisecond."""

    def __init__(
        self, listen: str, app: Callable[..., Iterable[bytes]], *, name: str = "metrics"
    ) -> None:
        super().__init__(listen, app, name=name, threads=4, idle_timeout_s=60.0)
