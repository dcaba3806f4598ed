"""The shared runner (gpudaemon/kube/runner.py) that the extender and the rebalancer
start, probe and close through, and the /metrics both serve from it: prometheus-client's
exposition with its content negotiation, so the rebalancer answers OpenMetrics and
gzip as the agent and the extender do."""

from __future__ import annotations

import gzip
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from gpudaemon.kube.informer import Reflector
from gpudaemon.kube.runner import Runner, observability_app
from tests.unit.rebalancer.test_rebalancer import rig


class _Client:
    """Lists one empty page per kind once `gate` is set; watches end at once."""

    def __init__(self, order: list[str]) -> None:
        self.order, self.gate, self.closed = order, threading.Event(), False

    def list_items(self, path: str, query: Mapping[str, str] | None = None) -> Any:
        self.gate.wait(10)
        self.order.append(f"list {path}")
        return [], "1"

    def watch(self, path: str, resource_version: str, timeout_s: float = 300.0,
              query: Mapping[str, str] | None = None) -> Iterator[Any]:  # fmt: skip
        yield from ()

    def close(self) -> None:
        self.order.append("client.close")


class _Server:
    def __init__(self, name: str, order: list[str]) -> None:
        self.name, self.order = name, order

    def start(self) -> None:
        self.order.append(f"{self.name}.start")

    def stop(self) -> None:
        self.order.append(f"{self.name}.stop")


def _reflector(client: _Client, kind: str) -> Reflector:
    return Reflector(client, kind, f"/{kind}", lambda items: None, lambda k, o: None)  # type: ignore[arg-type]


def test_servers_start_before_any_watch_and_ready_waits_for_every_first_list() -> None:
    order: list[str] = []
    client = _Client(order)
    runner = Runner([_reflector(client, "nodes"), _reflector(client, "pods")],
                    [_Server("api", order), _Server("metrics", order)], client=client)  # fmt: skip
    assert runner.ready() == (False, "waiting for the first list of: nodes, pods")
    runner.start()
    assert order[:2] == ["api.start", "metrics.start"]  # a bad address fails before any call
    client.gate.set()
    assert runner.wait_synced(10) and runner.ready() == (True, "ok") and runner.synced()
    assert runner.handler_errors() == {"nodes": 0, "pods": 0}
    order.clear()
    runner.close()
    assert runner.stop_event.is_set()
    assert order == ["api.stop", "metrics.stop", "client.close"]


def _get(app: Any, path: str, **headers: str) -> tuple[str, dict[str, str], bytes]:
    seen: dict[str, Any] = {}

    def start_response(status: str, hdrs: list[tuple[str, str]], exc: Any = None) -> None:
        seen["status"], seen["headers"] = status, dict(hdrs)

    env = {"PATH_INFO": path, "REQUEST_METHOD": "GET", "QUERY_STRING": "",
           **{"HTTP_" + k.upper(): v for k, v in headers.items()}}  # fmt: skip
    body = b"".join(app(env, start_response))
    return seen["status"], seen["headers"], body


def test_metrics_are_negotiated_and_probes_answer() -> None:
    registry = CollectorRegistry()
    Counter("demo", "A counter.", registry=registry).inc()
    app = observability_app(registry, lambda: (False, "waiting for nodes"))
    status, headers, body = _get(app, "/metrics")
    assert status.startswith("200") and headers["Content-Type"].startswith("text/plain")
    assert b"demo_total 1.0" in body
    _, headers, body = _get(app, "/metrics", accept="application/openmetrics-text")
    assert headers["Content-Type"].startswith("application/openmetrics-text")
    assert body.endswith(b"# EOF\n")
    _, headers, body = _get(app, "/metrics", accept_encoding="gzip")
    assert headers["Content-Encoding"] == "gzip" and b"demo_total" in gzip.decompress(body)
    assert _get(app, "/readyz")[0].startswith("503")
    assert _get(app, "/healthz")[0].startswith("200")
    assert _get(app, "/nope")[0].startswith("404")


def test_the_rebalancer_serves_metrics_as_the_others_do() -> None:
    """Its server's app is the runner's: OpenMetrics when asked (its hand-made /metrics
    answered text 0.0.4 whatever the Accept header said)."""
    rb, _, _ = rig()
    _, headers, body = _get(rb.server.app, "/metrics", accept="application/openmetrics-text")
    assert headers["Content-Type"].startswith("application/openmetrics-text")
    assert b"gpudaemon_rebalancer_dry_run 1.0" in body and body.endswith(b"# EOF\n")
    assert _get(rb.server.app, "/readyz")[0].startswith("503")  # nothing listed yet
