"""The extender's HTTP API: kube-scheduler's extender wire format over WSGI, and
nothing else.

Decode `ExtenderArgs`, hand the pod and node names to the framework (framework.py:
filter, score, reserve), encode `ExtenderFilterResult` / `HostPriorityList`, and map
failures to status codes (400 bad body, 503 not ready, 500 a bug).
The upstream types carry no JSON tags (Go matches keys case-insensitively), so keys
are read in either case and written capitalised, as Go writes them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from loguru import logger
from prometheus_client import CollectorRegistry

from gpudaemon.cluster.clusterstate import ClusterState
from gpudaemon.cluster.policies.base import Policy
from gpudaemon.cluster.reservations import LeaseReservations
from gpudaemon.cluster.state import NodeState, PodShape
from gpudaemon.config import PluginsConfig
from gpudaemon.extender.framework import BadPod, Framework, NotReady
from gpudaemon.extender.metrics import ExtenderMetrics, NodeCollector
from gpudaemon.extender.pods import PodVerifier
from gpudaemon.httpserver import Readiness, StartResponse
from gpudaemon.kube.runner import observability_app
from gpudaemon.logsetup import LogLimiter

JSON_HEADERS = [("Content-Type", "application/json")]


class BadRequest(ValueError):
    """The body is not a valid ExtenderArgs: answered 400 with this message."""


@dataclass(frozen=True)
class Args:
    pod: Mapping[str, Any]
    names: list[str]
    nodes: list[Mapping[str, Any]] | None  # the full Node objects when not cache-capable


def _key(d: Mapping[str, Any], name: str) -> Any:
    if name in d:
        return d[name]
    lower = name.lower()
    for k, v in d.items():
        if isinstance(k, str) and k.lower() == lower:
            return v
    return None


def parse_args(body: bytes) -> Args:
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise BadRequest(f"body is not valid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise BadRequest(f"ExtenderArgs must be a JSON object, not {type(doc).__name__}")
    pod = _key(doc, "Pod")
    if not isinstance(pod, dict):
        raise BadRequest("ExtenderArgs.Pod must be an object")
    names = _key(doc, "NodeNames")
    nodes = _key(doc, "Nodes")
    if names is not None:
        if not isinstance(names, list) or not set(map(type, names)) <= {str}:
            raise BadRequest("ExtenderArgs.NodeNames must be a list of strings")
        return Args(pod, names, None)
    if nodes is None:
        raise BadRequest("ExtenderArgs needs NodeNames (nodeCacheCapable) or Nodes")
    items = _key(nodes, "Items") if isinstance(nodes, dict) else None
    if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
        raise BadRequest("ExtenderArgs.Nodes.Items must be a list of Node objects")
    out_names = []
    for i in items:
        name = (i.get("metadata") or {}).get("name")
        if not isinstance(name, str):
            raise BadRequest("every Node in ExtenderArgs.Nodes needs metadata.name")
        out_names.append(name)
    return Args(pod, out_names, items)


class ExtenderApi:
    """The WSGI app around one `Framework` (which owns the decisions and their lock)."""

    def __init__(
        self,
        cluster: ClusterState,
        policies: Mapping[str, Policy],
        default_policy: str,
        registry: CollectorRegistry,
        ready: Readiness,
        *,
        avoid_unhealthy: bool = True,
        prefer_healthy_gpus: bool = True,
        gpuless_pods: str = "full_nodes_first",
        candidates: int = 0,
        observe: Callable[[str, PodShape], None] | None = None,
        verifier: PodVerifier | None = None,
        reservations: LeaseReservations | None = None,
        clock: Callable[[], float] = time.perf_counter,
        plugins: PluginsConfig | None = None,
        nodes: NodeCollector | None = None,
    ) -> None:
        """`nodes`: the per-node families, served after `registry`'s and rendered by the
        collector itself (25,000 series at 5,000 nodes: prometheus-client took 0.4-0.6 s
        a scrape, the collector 27 ms; docs/benchmarks.md)."""
        self.metrics = ExtenderMetrics(registry)
        self.framework = Framework(
            cluster,
            policies,
            default_policy,
            self.metrics,
            lambda: self.ready(),  # read at each request: the wiring may swap it
            avoid_unhealthy=avoid_unhealthy,
            prefer_healthy_gpus=prefer_healthy_gpus,
            gpuless_pods=gpuless_pods,
            candidates=candidates,
            observe=observe,
            verifier=verifier,
            reservations=reservations,
            plugins=plugins,
        )
        self.ready = ready
        self.clock = clock
        self._bug_log = LogLimiter(60.0)  # a traceback per kind of failure per minute
        # /metrics, /healthz, /readyz: served as the rebalancer serves them (kube.runner).
        # Every series /metrics serves (`?name[]=` and any other query read it whole).
        self.served = registry
        if nodes is not None:
            self.served = CollectorRegistry()
            self.served.register(registry)
            self.served.register(nodes)
        self._observe = observability_app(
            self.served,
            lambda: self.ready(),  # read at each request: the wiring may swap it
            "not found: try POST /filter, POST /prioritize, /healthz, /readyz, /metrics\n",
            head=registry if nodes is not None else None,
            render=nodes.render if nodes is not None else None,
        )

    # What callers (tests, the wiring) read; the framework owns them.
    @property
    def cluster(self) -> ClusterState:
        return self.framework.cluster

    @property
    def policies(self) -> dict[str, Policy]:
        return self.framework.policies

    @property
    def default_policy(self) -> str:
        return self.framework.default_policy

    # -- WSGI ---------------------------------------------------------------------

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/")
        method = environ.get("REQUEST_METHOD", "GET")
        if path in ("/filter", "/prioritize"):
            if method != "POST":
                return _reply(start_response, "405 Method Not Allowed", {"Error": "use POST"})
            return self._verb(path[1:], environ, start_response)
        return self._observe(environ, start_response)

    def _verb(
        self, verb: str, environ: dict[str, Any], start_response: StartResponse
    ) -> Iterable[bytes]:
        t0 = self.clock()
        code = "200"
        try:
            try:
                length = int(environ.get("CONTENT_LENGTH") or 0)
            except ValueError:
                length = -1
            if length <= 0:
                raise BadRequest("request body is empty (send ExtenderArgs as JSON)")
            args = parse_args(environ["wsgi.input"].read(length))
            result = self.filter(args) if verb == "filter" else self.prioritize(args)
            return _reply(start_response, "200 OK", result)
        except (BadRequest, BadPod) as e:
            code = "400"
            return _reply(start_response, "400 Bad Request", {"Error": str(e)})
        except NotReady as e:
            code = "503"
            body = {"Error": f"gpudaemon extender not ready: {e}"}
            return _reply(start_response, "503 Service Unavailable", body)
        except Exception as e:  # a bug: answer in the wire format, keep serving
            code = "500"
            if self._bug_log.allow(type(e).__name__):
                logger.opt(exception=e).error("extender: {} failed: {!r}", verb, e)
            reason = f"gpudaemon extender: internal error in {verb}: {type(e).__name__}"
            return _reply(start_response, "500 Internal Server Error", {"Error": reason})
        finally:
            self.metrics.requests.labels(verb, code).inc()
            self.metrics.request_seconds.labels(verb).observe(self.clock() - t0)

    # -- verbs: decode, decide (framework.py), encode -------------------------------

    def filter(self, args: Args) -> dict[str, Any]:
        result = self.framework.filter(args.pod, args.names)
        if args.nodes is None:
            return {"NodeNames": result.passed, "FailedNodes": result.failed, "Error": ""}
        keep = set(result.passed)
        items = [n for n in args.nodes if (n.get("metadata") or {}).get("name") in keep]
        return {"Nodes": {"items": items}, "FailedNodes": result.failed, "Error": ""}

    def prioritize(self, args: Args) -> list[dict[str, Any]]:
        return [{"Host": n, "Score": s} for n, s in self.framework.score(args.pod, args.names)]


def _reply(start_response: StartResponse, status: str, doc: object) -> list[bytes]:
    body = orjson.dumps(doc)
    start_response(status, [*JSON_HEADERS, ("Content-Length", str(len(body)))])
    return [body]


__all__ = ["Args", "BadRequest", "ExtenderApi", "NodeState", "parse_args"]
