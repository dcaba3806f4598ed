"""The extender's HTTP API: kube-scheduler's extender wire format over WSGI.

Thin on purpose: decode `ExtenderArgs`, read node states from the caches, call the pure
filter and policy functions, encode `ExtenderFilterResult` / `HostPriorityList`.
The upstream types carry no JSON tags (Go matches keys case-insensitively), so keys
are read in either case and written capitalised, as Go writes them.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from loguru import logger
from prometheus_client import CollectorRegistry, make_wsgi_app

from gpudaemon.extender.cluster import ClusterState
from gpudaemon.extender.metrics import ExtenderMetrics
from gpudaemon.extender.pods import PodVerifier
from gpudaemon.extender.podspec import POLICY_ANNOTATION, pod_policy, pod_shape
from gpudaemon.extender.policies.base import Policy, UnknownPolicyError
from gpudaemon.extender.scoring import MAX_SCORE, Rejection, ScoreMemo, best_nodes, check_node, rank
from gpudaemon.extender.state import NodeState, PodShape
from gpudaemon.httpserver import Readiness, StartResponse, probe_response, text_response
from gpudaemon.logsetup import LogLimiter

JSON_HEADERS = [("Content-Type", "application/json")]


class BadRequest(ValueError):
    """The body is not a valid ExtenderArgs: answered 400 with this message."""


class UnknownPodPolicy(ValueError):
    """The pod's annotation names no registered policy: every node fails with this."""


class NotReady(RuntimeError):
    """The caches have not listed yet: answered 503, so the scheduler retries soon.
    Empty caches would judge every node "no agent data" and the scheduler would park
    the pod as unschedulable."""


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
    """The WSGI app. Decisions are serialised under one lock: a pod's ranking and the
    assumption it leaves behind are one step, so concurrent requests (two scheduler
    replicas, or retries) never score from a count another request is about to change."""

    def __init__(
        self,
        cluster: ClusterState,
        policies: Mapping[str, Policy],
        default_policy: str,
        registry: CollectorRegistry,
        ready: Readiness,
        *,
        avoid_unhealthy: bool = True,
        candidates: int = 0,
        observe: Callable[[str, PodShape], None] | None = None,
        verifier: PodVerifier | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if default_policy not in policies:
            raise UnknownPolicyError(default_policy)
        self.cluster = cluster
        self.policies = dict(policies)
        self.default_policy = default_policy
        self.metrics = ExtenderMetrics(registry)
        self.ready = ready
        self.avoid_unhealthy = avoid_unhealthy
        self.candidates = candidates
        self.observe = observe
        # None trusts the body's pod (in-process tests and benchmarks only): the
        # `gpudaemon extender` program always verifies (see pods.py).
        self.verifier = verifier
        self.clock = clock
        self._lock = threading.Lock()
        self._scores = ScoreMemo()  # used under _lock
        self._bug_log = LogLimiter(60.0)  # a traceback per kind of failure per minute
        self._metrics_app = make_wsgi_app(registry)
        for p in self.policies.values():  # what they learn from nodes, off the request path
            cluster.add_node_listener(p)

    # -- WSGI ---------------------------------------------------------------------

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/")
        method = environ.get("REQUEST_METHOD", "GET")
        if path in ("/filter", "/prioritize"):
            if method != "POST":
                return _reply(start_response, "405 Method Not Allowed", {"Error": "use POST"})
            return self._verb(path[1:], environ, start_response)
        if path == "/metrics":
            return self._metrics_app(environ, start_response)  # type: ignore[no-any-return]
        probe = probe_response(path, self.ready, start_response)
        if probe is not None:
            return probe
        return text_response(
            start_response,
            "404 Not Found",
            "not found: try POST /filter, POST /prioritize, /healthz, /readyz, /metrics\n",
        )

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
        except BadRequest as e:
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

    # -- verbs --------------------------------------------------------------------

    def _shape(self, pod: Mapping[str, Any]) -> PodShape:
        try:
            return pod_shape(pod, self.cluster.product_label)
        except ValueError as e:
            raise BadRequest(f"pod resources: {e}") from None
        except (AttributeError, TypeError):
            raise BadRequest("pod spec is malformed (containers/resources)") from None

    def _policy(self, pod: Mapping[str, Any]) -> Policy:
        """The pod's policy (annotation), else the default. An unknown name is an error
        the scheduler shows the user, not a silent fallback."""
        chosen = pod_policy(pod)
        if chosen is None:
            return self.policies[self.default_policy]
        policy = self.policies.get(chosen)
        if policy is None:
            raise UnknownPodPolicy(
                f"gpudaemon: unknown policy {chosen!r} in annotation {POLICY_ANNOTATION}"
                f" (known: {', '.join(sorted(self.policies))})"
            )
        return policy

    def filter(self, args: Args) -> dict[str, Any]:
        shape = self._shape(args.pod)
        if shape.gpus <= 0:  # not ours to judge: pass everything through, quickly
            return self._filter_result(args, args.names, {})
        self._require_ready()
        try:
            policy = self._policy(args.pod)
        except UnknownPodPolicy as e:
            self.metrics.filter_nodes.labels("unknown_policy").inc(len(args.names))
            return self._filter_result(args, [], {n: str(e) for n in args.names})
        real = self._real_pod(args.pod, shape)
        if real is not None:
            for p in self.policies.values():
                p.observe_pod(real[0], real[1])
            if self.observe is not None:
                self.observe(real[0], real[1])
        failed: dict[str, str] = {}
        passed: list[str] = []
        removed: Counter[str] = Counter()  # by reason; one metric update per reason
        with self._lock:
            states = self.cluster.states(args.names)
            fresh = self.cluster.freshness(args.names)
            for name in args.names:
                why = check_node(
                    states[name], shape, fresh=fresh[name], avoid_unhealthy=self.avoid_unhealthy
                )
                if why is None:
                    passed.append(name)
                else:
                    failed[name] = _reason(why)
                    removed[why.reason] += 1
            if 0 < self.candidates < len(passed):
                # Narrow to the policy's best nodes. Those outranked are not listed in
                # FailedNodes: the scheduler reads that map only for a pod that fits
                # nowhere, and here some node fits; listing them would cost the
                # scheduler a map of every node to decode per pod.
                raw = self._scores.scores(policy, shape, passed, states)
                if raw:  # none scorable (our CPU/memory view says no node fits, the
                    # scheduler's says some do): leave the choice to the scheduler
                    keep = best_nodes(raw, self.candidates)
                    if len(keep) < self.candidates:  # fill up with the unscored ones
                        keep += [n for n in passed if n not in raw][: self.candidates - len(keep)]
                    removed["outranked"] += len(passed) - len(keep)
                    passed = keep
            if (
                real is not None
                and len(passed) == 1
                and (s := states[passed[0]]) is not None
                and s.can_host(real[1])
            ):
                # The scheduler skips /prioritize with one feasible node, so the pod
                # would never be assumed: assume it here, or the next pods of a burst
                # are judged from a count that misses it.
                self._assume(real[0], passed[0], real[1])
        for reason, count in removed.items():
            self.metrics.filter_nodes.labels(reason).inc(count)
        self.metrics.filter_nodes.labels("passed").inc(len(passed))
        return self._filter_result(args, passed, failed)

    def prioritize(self, args: Args) -> list[dict[str, Any]]:
        shape = self._shape(args.pod)
        try:
            policy = self._policy(args.pod)
        except UnknownPodPolicy:  # /filter already failed every node with the reason
            return [{"Host": n, "Score": 0} for n in args.names]
        # A GPU-less pod reaches us only without managedResources; neutral unless the
        # policy judges where it strands GPUs (fragmentation does).
        if shape.gpus <= 0 and not policy.scores_gpuless_pods:
            return [{"Host": n, "Score": 0} for n in args.names]
        self._require_ready()
        real = self._real_pod(args.pod, shape)
        with self._lock:
            states = self.cluster.states(args.names)
            raw = self._scores.scores(policy, shape, args.names, states)
            top, level = rank(raw)
            if top is not None and real is not None:
                self._assume(real[0], top, real[1])
        get = raw.get
        return [
            {"Host": n, "Score": MAX_SCORE if n == top else level.get(get(n), 0)}  # type: ignore[arg-type]
            for n in args.names
        ]

    def _real_pod(self, pod: Mapping[str, Any], shape: PodShape) -> tuple[str, PodShape] | None:
        """(UID, requests) of the real pod behind the body, or None: then nothing is
        booked or learned for it, and the reason is counted."""
        if self.verifier is None:  # trusted (tests, benchmarks); "" is never assumed
            return _uid(pod), shape
        real, why = self.verifier.verify(pod)
        if real is None:
            self.metrics.unverified.labels(why).inc()
            return None
        return real.uid, real.shape

    def _require_ready(self) -> None:
        ready, why = self.ready()
        if not ready:
            raise NotReady(why)

    def _assume(self, uid: str, node: str, shape: PodShape) -> None:
        if uid:
            self.cluster.assume(uid, node, shape)
            self.metrics.assumed.inc()

    @staticmethod
    def _filter_result(args: Args, passed: Sequence[str], failed: dict[str, str]) -> dict[str, Any]:
        if args.nodes is None:
            return {"NodeNames": list(passed), "FailedNodes": failed, "Error": ""}
        keep = set(passed)
        items = [n for n in args.nodes if (n.get("metadata") or {}).get("name") in keep]
        return {"Nodes": {"items": items}, "FailedNodes": failed, "Error": ""}


def _uid(pod: Mapping[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    uid = meta.get("uid") if isinstance(meta, dict) else None
    return uid if isinstance(uid, str) else ""


def _reason(r: Rejection) -> str:
    return f"gpudaemon: {r.message}"


def _reply(start_response: StartResponse, status: str, doc: object) -> list[bytes]:
    body = orjson.dumps(doc)
    start_response(status, [*JSON_HEADERS, ("Content-Length", str(len(body)))])
    return [body]


__all__ = ["Args", "BadRequest", "ExtenderApi", "NodeState", "parse_args"]
