"""Start, readiness, /metrics and close for a program fed by informers and served over
HTTP: the extender and the rebalancer share it. Ready means every reflector has landed
its first list.

Start order: the HTTP servers first (a bad listen address exits 2 before any API
call), then one daemon thread per reflector. Close order: stop the watches' loop,
stop serving (in the order the servers were given), then close the client. The
watch threads are daemons: one blocked on a silent server must not hold up exit.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from prometheus_client import CollectorRegistry

from gpudaemon.httpserver import Readiness, StartResponse, WsgiApp, probe_response, text_response
from gpudaemon.httpserver.exposition import Render, metrics_app
from gpudaemon.kube.informer import Reflector

NOT_FOUND = "not found: try /metrics, /healthz, /readyz\n"


class Server(Protocol):
    def start(self) -> None: ...

    def stop(self) -> None: ...


def observability_app(
    registry: CollectorRegistry,
    ready: Readiness,
    not_found: str = NOT_FOUND,
    *,
    head: CollectorRegistry | None = None,
    render: Render | None = None,
) -> WsgiApp:
    """/metrics (text or OpenMetrics by the Accept header, gzip by Accept-Encoding,
    `?name[]=` filtering; with `head` and `render`, one big collector's families
    encoded by `render` rather than by prometheus-client: httpserver/exposition.py),
    /healthz and /readyz; 404 with `not_found` for anything else."""
    metrics = metrics_app(registry, head, render)

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/")
        if path == "/metrics":
            return metrics(environ, start_response)
        probe = probe_response(path, ready, start_response)
        if probe is not None:
            return probe
        return text_response(start_response, "404 Not Found", not_found)

    return app


class Runner:
    """The reflectors and HTTP servers of one program, started and closed in order."""

    def __init__(
        self,
        reflectors: Sequence[Reflector],
        servers: Sequence[Server] = (),
        *,
        client: object = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.reflectors = list(reflectors)
        self.servers = list(servers)
        self.client = client
        self.clock = clock
        self.stop_event = threading.Event()
        self.threads: list[threading.Thread] = []

    def ready(self) -> tuple[bool, str]:
        waiting = [r.kind for r in self.reflectors if not r.synced.is_set()]
        if waiting:
            return False, "waiting for the first list of: " + ", ".join(waiting)
        return True, "ok"

    def synced(self) -> bool:
        return all(r.synced.is_set() for r in self.reflectors)

    def wait_synced(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        return all(r.synced.wait(max(0.0, deadline - time.monotonic())) for r in self.reflectors)

    def handler_errors(self) -> dict[str, int]:
        """Objects each watch's handler could not take (the bad-data metric)."""
        return {r.kind: r.handler_errors for r in self.reflectors}

    def cache_ages(self) -> dict[str, float | None]:
        """Seconds since each watch's last list or event (None: never)."""
        now = self.clock()
        return {
            r.kind: None if r.last_sync_at is None else max(0.0, now - r.last_sync_at)
            for r in self.reflectors
        }

    def start(self) -> None:
        for server in self.servers:
            server.start()
        for r in self.reflectors:
            t = threading.Thread(
                target=r.run, args=(self.stop_event,), name=f"watch-{r.kind}", daemon=True
            )
            t.start()
            self.threads.append(t)

    def close(self) -> None:
        self.stop_event.set()
        for server in self.servers:
            server.stop()
        close = getattr(self.client, "close", None)
        if callable(close):
            close()
