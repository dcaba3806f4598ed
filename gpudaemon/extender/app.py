"""Wiring for `gpudaemon extender`: client, caches, informers, policies, HTTP server.

Start, readiness and shutdown are the shared `kube.runner.Runner`'s: serve first, then
watch; on close stop the watches' loop, stop serving (the scheduler falls back on its
timeout), then close the client.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from loguru import logger
from prometheus_client import CollectorRegistry

from gpudaemon import __version__
from gpudaemon.cluster.clusterstate import ClusterState
from gpudaemon.cluster.drawatch import dra_informers
from gpudaemon.cluster.metrics import BadDataCollector, DraCollector
from gpudaemon.cluster.plugins import check_plugins
from gpudaemon.cluster.policies import Policy, build_policies, policy_spec
from gpudaemon.cluster.reservations import LeaseReservations, ReservationCollector
from gpudaemon.cluster.selectors import unschedulable_since
from gpudaemon.config import ExtenderSettings
from gpudaemon.errors import ConfigError
from gpudaemon.extender.api import ExtenderApi
from gpudaemon.extender.metrics import CacheCollector, NodeCollector
from gpudaemon.extender.pods import PendingPods, PodVerifier
from gpudaemon.httpserver import (
    HttpServer,
    StartResponse,
    TlsFiles,
    TlsHttpServer,
    WsgiApp,
    text_response,
)
from gpudaemon.kube.client import KubeClient, find_credentials
from gpudaemon.kube.informer import ListWatchClient
from gpudaemon.kube.informers import InformerFactory
from gpudaemon.kube.runner import Runner

LOOKUP_TIMEOUT_S = 1.0


def make_policies(cfg: ExtenderSettings) -> dict[str, Policy]:
    """Every registered policy (cluster/policies/), built from the `extender:` section;
    an unknown `extender.policy` or plug-in name (`extender.plugins`) is a ConfigError
    naming the known ones (exit 2)."""
    policy_spec(cfg.extender.policy)
    check_plugins(cfg.extender.plugins)
    return build_policies(cfg.extender)


def observability_only(app: WsgiApp) -> WsgiApp:
    """`app` without the scheduler verbs: for the plain metrics/probe address."""

    def wsgi(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        if environ.get("PATH_INFO") in ("/filter", "/prioritize"):
            return text_response(
                start_response,
                "404 Not Found",
                "the scheduler verbs are served on extender.listen only\n",
            )
        return app(environ, start_response)

    return wsgi


class Extender:
    def __init__(
        self,
        cfg: ExtenderSettings,
        client: ListWatchClient | None = None,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        # First: an unknown policy exits 2 with one line, before any API call.
        self.policies = make_policies(cfg)
        if client is None:
            creds = find_credentials(cfg.kubernetes.kubeconfig, bool(cfg.kubernetes.in_cluster))
            if creds is None:
                raise ConfigError(
                    "extender: no Kubernetes credentials (not in a pod, no kubeconfig);"
                    " set kubernetes.kubeconfig or $KUBECONFIG"
                )
            client = KubeClient.from_credentials(creds, cfg.kubernetes.request_timeout_seconds)
        self.client = client
        self.clock = clock
        kube = client
        self.registry = registry or CollectorRegistry()
        ext = cfg.extender
        self.cluster = ClusterState(
            cfg.labels.prefix,
            assume_ttl_s=ext.assume_ttl_seconds,
            gang_assume_ttl_s=ext.gang_assume_ttl_seconds,
            dra=cfg.dra.enabled,
        )
        self.pending = PendingPods(self.cluster.product_label)
        self.cluster.gang_waits = self.pending.waits_at_permit
        # The rebalancer's reservations: read from its Lease, which the Lease watch of
        # the agents' namespace sees anyway (reservations.py).
        self.reservations = LeaseReservations()
        c = self.cluster
        # One list + watch per resource and selector; each cache registers its handlers.
        f = self.informers = InformerFactory(
            client, backoff_max_s=cfg.kubernetes.backoff_max_seconds, clock=clock
        )
        # Nodes and bound pods: their stores hold ClusterState's records of them, which it
        # reads as its view (one copy each).
        _, _, leases = c.watch(f, cfg.kubernetes.lease_namespace)
        leases.add_handler(self.reservations.replace, self.reservations.event)
        # Our scheduler's pending pods: the store holds PendingPods' parsed form of each,
        # which it reads; then what a pending pod's event says of its assumption.
        pending = self.pending.watch(f, ext.scheduler_name)
        pending.add_handler(lambda items: None, self._pending_event)
        if cfg.dra.enabled:
            dra_informers(f, c)
        self.reflectors = f.reflectors
        self.runner = Runner(self.reflectors, client=client, clock=clock)
        self.verifier = PodVerifier(
            self.pending,
            # Short: it runs inside a scheduler request (httpTimeout 5 s); a slow API
            # server costs one unbooked pod, not a failed scheduling attempt.
            lambda ns, name: kube.request(
                "GET", f"/api/v1/namespaces/{ns}/pods/{name}", timeout_s=LOOKUP_TIMEOUT_S
            ),
            ext.scheduler_name,
            is_bound=self.cluster.is_bound,
            lookups_per_second=ext.pod_lookups_per_second,
        )
        self.api = ExtenderApi(
            self.cluster,
            self.policies,
            ext.policy,
            self.registry,
            self.ready,
            avoid_unhealthy=ext.avoid_unhealthy_nodes,
            prefer_healthy_gpus=ext.prefer_healthy_gpus,
            gpuless_pods=ext.gpuless_pods,
            candidates=ext.candidates,
            verifier=self.verifier,
            reservations=self.reservations,
            plugins=ext.plugins,
            nodes=NodeCollector(self.cluster),  # /metrics adds them, rendered fast
        )
        self.registry.register(ReservationCollector(self.reservations))
        self.registry.register(CacheCollector(self.sizes, self.cache_ages))
        self.registry.register(DraCollector("extender", self.cluster.dra_counts))
        self.registry.register(
            BadDataCollector("extender", self.cluster.bad_counts, self.runner.handler_errors)
        )
        limits: dict[str, Any] = {
            "name": "extender",
            "threads": ext.threads,
            "max_body_bytes": ext.max_body_bytes,
            "body_budget_bytes": ext.body_budget_bytes,
            "read_timeout_s": ext.read_timeout_seconds,
            "idle_timeout_s": ext.idle_timeout_seconds,
            "max_connections": ext.max_connections,
            "max_header_bytes": ext.max_header_bytes,
        }
        self.server: HttpServer | TlsHttpServer
        if ext.tls.enabled:
            files = TlsFiles(ext.tls.cert_file, ext.tls.key_file, ext.tls.client_ca_file)
            self.server = TlsHttpServer(ext.listen, self.api, files, **limits)
        else:
            self.server = HttpServer(ext.listen, self.api, **limits)
        self.metrics_server: HttpServer | None = None
        if ext.metrics_listen:
            self.metrics_server = HttpServer(
                ext.metrics_listen, observability_only(self.api), name="extender.metrics", threads=2
            )
        self.runner.servers = [self.server, *([self.metrics_server] if self.metrics_server else [])]
        self.stop_event = self.runner.stop_event

    def ready(self) -> tuple[bool, str]:
        return self.runner.ready()

    def sizes(self) -> dict[str, int]:
        return {
            **self.cluster.sizes(),
            "pending": len(self.pending),
            "unverified_uids": self.verifier.negative_size_now(),
        }

    def cache_ages(self) -> dict[str, float | None]:
        return self.runner.cache_ages()

    def _pending_event(self, kind: str, obj: Mapping[str, Any]) -> None:
        if kind == "DELETED":  # deleted or bound: its assumption goes soon either way
            self.cluster.left_pending(str((obj.get("metadata") or {}).get("uid") or ""))
            return
        failed = unschedulable_since(obj) if kind == "MODIFIED" else None
        if failed is not None:
            uid = str((obj.get("metadata") or {}).get("uid") or "")
            self.cluster.unassume_if_failed_since(uid, failed)

    def start(self) -> None:
        self.runner.start()  # servers first: a bad listen address exits 2 before any API call
        logger.info(
            "gpudaemon {} extender listening on {} (policy {}, policies: {})",
            __version__,
            self.server.listen,
            self.cfg.extender.policy,
            ", ".join(sorted(self.policies)),
        )

    def wait_synced(self, timeout_s: float) -> bool:
        return self.runner.wait_synced(timeout_s)

    def run(self) -> int:
        self.start()
        try:
            self.stop_event.wait()
        finally:
            self.close()
        return 0

    def close(self) -> None:
        self.runner.close()
