"""The only module that imports the kubernetes client: the agent's own Node labels and
annotations (server-side apply) and its per-node freshness Lease.

The client is used thinly (ApiClient for kubeconfig/in-cluster auth and TLS, raw REST
calls for the three requests we make), so no generated model is built per request and
library errors are turned into our `APIError` family right here.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loguru import logger

from gpudaemon.errors import (
    APIConflictError,
    APIError,
    APIForbiddenError,
    APIInvalidError,
    APINotFoundError,
    APIUnavailableError,
    ConfigError,
    SinkError,
)
from gpudaemon.labels import Labels, LabelSet

if TYPE_CHECKING:
    from gpudaemon.config import Config
    from gpudaemon.metrics.agent import AgentMetrics

SA_TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")
FIELD_MANAGER = "gpudaemon"
APPLY_PATCH = "application/apply-patch+yaml"
# Connect fails fast (a dead server refuses at once; a black-holed one should not hold
# a job for long); the read timeout comes from the config.
CONNECT_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class Credentials:
    in_cluster: bool
    kubeconfig: str = ""


def find_credentials(kubeconfig: str = "") -> Credentials | None:
    """In-cluster service account first, then the kubeconfig; None if neither exists."""
    if kubeconfig:
        return Credentials(in_cluster=False, kubeconfig=kubeconfig)
    if os.environ.get("KUBERNETES_SERVICE_HOST") and SA_TOKEN.is_file():
        return Credentials(in_cluster=True)
    for candidate in filter(
        None,
        [
            *os.environ.get("KUBECONFIG", "").split(os.pathsep),
            str(Path.home() / ".kube" / "config"),
        ],
    ):
        if Path(candidate).is_file():
            return Credentials(in_cluster=False, kubeconfig=candidate)
    return None


# -- transport -------------------------------------------------------------------------


def _error_for(status: int, method: str, path: str, body: bytes) -> APIError:
    """Map an HTTP status to our error type, with the server's own message."""
    reason = body[:300].decode(errors="replace")
    with contextlib.suppress(ValueError, AttributeError):
        reason = str(json.loads(body).get("message", reason))
    msg = f"{method} {path}: HTTP {status}: {reason}"
    if status in (401, 403):
        return APIForbiddenError(msg, status)
    if status == 404:
        return APINotFoundError(msg, status)
    if status == 409:
        return APIConflictError(msg, status)
    if status in (400, 422):
        return APIInvalidError(msg, status)
    return APIUnavailableError(msg, status)


class KubeClient:
    """Three REST calls over the official client's ApiClient (auth, TLS, pooling).

    Retries are off in urllib3: our own backoff decides when to try again, so a dead
    server costs one connect timeout per attempt, not four.
    """

    def __init__(self, api_client: Any, timeout_s: float) -> None:
        self.api = api_client
        self.timeout = (CONNECT_TIMEOUT_S, timeout_s)

    @classmethod
    def from_credentials(cls, creds: Credentials, timeout_s: float = 10.0) -> KubeClient:
        from kubernetes import client, config

        conf = client.Configuration()
        try:
            if creds.in_cluster:
                config.load_incluster_config(client_configuration=conf)  # type: ignore[no-untyped-call]
            else:
                config.load_kube_config(  # type: ignore[no-untyped-call]
                    config_file=creds.kubeconfig,
                    client_configuration=conf,
                    persist_config=False,
                )
        except Exception as e:  # ConfigException, YAML, OS, key errors: all one line
            where = "in-cluster config" if creds.in_cluster else f"kubeconfig {creds.kubeconfig}"
            raise ConfigError(f"{where}: {' '.join(str(e).split())}") from None
        conf.retries = False
        return cls(client.ApiClient(conf), timeout_s)

    def request(
        self,
        method: str,
        path: str,
        query: Mapping[str, str] | None = None,
        body: Any = None,
        content_type: str | None = None,
    ) -> dict[str, Any]:
        import urllib3

        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        try:
            _m, url, hdrs, body_, _p = self.api.param_serialize(
                method,
                path,
                query_params=list((query or {}).items()),
                header_params=headers,
                body=body,
                auth_settings=["BearerToken"],
            )
            resp = self.api.call_api(method, url, hdrs, body_, _request_timeout=self.timeout)
            data = resp.read()
        except urllib3.exceptions.HTTPError as e:
            raise APIUnavailableError(f"{method} {path}: {_short(e)}") from None
        except OSError as e:
            raise APIUnavailableError(f"{method} {path}: {e}") from None
        if not 200 <= resp.status < 300:
            raise _error_for(resp.status, method, path, data)
        try:
            out = json.loads(data) if data else {}
        except ValueError:
            raise APIUnavailableError(f"{method} {path}: response is not JSON") from None
        return out if isinstance(out, dict) else {}

    def get_node(self, name: str) -> dict[str, Any]:
        return self.request("GET", f"/api/v1/nodes/{name}")

    def apply_node(self, name: str, labels: Mapping[str, str], ann: Mapping[str, str]) -> Any:
        body = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": name, "labels": dict(labels), "annotations": dict(ann)},
        }
        return self.request("PATCH", f"/api/v1/nodes/{name}", _APPLY_QUERY, body, APPLY_PATCH)

    def apply_lease(
        self,
        namespace: str,
        name: str,
        spec: Mapping[str, Any],
        owner: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        meta: dict[str, Any] = {"name": name, "namespace": namespace}
        if owner:
            meta["ownerReferences"] = [dict(owner)]
        body = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": meta,
            "spec": dict(spec),
        }
        path = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{name}"
        return self.request("PATCH", path, _APPLY_QUERY, body, APPLY_PATCH)

    def close(self) -> None:
        self.api.close()


# force: keys under our prefix are ours; take them back from a hand edit.
_APPLY_QUERY = {"fieldManager": FIELD_MANAGER, "force": "true"}


def _short(e: Exception) -> str:
    """urllib3 wraps the real cause several layers deep; keep the last line."""
    reason = getattr(e, "reason", None) or e
    return " ".join(str(reason).split())[:200]


# -- backoff -----------------------------------------------------------------------------


class Backoff:
    """Exponential backoff with "equal jitter": delay in [d/2, d], d = base*2^n <= cap.

    Half the delay is kept so retries after a long outage stay spread out but never
    come sooner than half the cap; the jitter keeps a fleet from retrying in lockstep.
    """

    def __init__(
        self, base_s: float, cap_s: float, rng: Callable[[], float] = random.random
    ) -> None:
        self.base, self.cap, self.rng = base_s, cap_s, rng
        self.failures = 0

    def next_delay(self) -> float:
        d = min(self.cap, self.base * float(2 ** min(self.failures, 30)))
        self.failures += 1
        return d / 2 + self.rng() * d / 2

    def reset(self) -> None:
        self.failures = 0


# -- node state comparison ---------------------------------------------------------------


def owned_keys(node: Mapping[str, Any], manager: str = FIELD_MANAGER) -> tuple[set[str], set[str]]:
    """Label and annotation keys the manager's Apply owns, from managedFields."""
    labels: set[str] = set()
    ann: set[str] = set()
    for entry in node.get("metadata", {}).get("managedFields") or []:
        if entry.get("manager") != manager or entry.get("operation") != "Apply":
            continue
        meta = (entry.get("fieldsV1") or {}).get("f:metadata", {})
        labels |= {k[2:] for k in meta.get("f:labels", {}) if k.startswith("f:")}
        ann |= {k[2:] for k in meta.get("f:annotations", {}) if k.startswith("f:")}
    return labels, ann


def in_sync(node: Mapping[str, Any], desired: Mapping[str, Mapping[str, str]]) -> bool:
    """True when the Node holds exactly our desired keys, owned by us, with our values."""
    meta = node.get("metadata", {})
    labels, ann = meta.get("labels") or {}, meta.get("annotations") or {}
    own_l, own_a = owned_keys(node)
    want_l, want_a = desired["labels"], desired["annotations"]
    return (
        own_l == set(want_l)
        and own_a == set(want_a)
        and all(labels.get(k) == v for k, v in want_l.items())
        and all(ann.get(k) == v for k, v in want_a.items())
    )


def micro_time(t: float) -> str:
    """A Kubernetes MicroTime (RFC 3339 with microseconds, UTC)."""
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def renew_cron(lease_duration_s: int) -> str:
    """Renew every duration/4, like kubelet's node lease (40 s -> every 10 s)."""
    every = max(1, lease_duration_s // 4)
    if every < 60:
        return f"*/{every} * * * * *"
    return f"0 */{max(1, every // 60)} * * * *"


# -- the sink -----------------------------------------------------------------------------


class KubeSink:
    """Keeps the agent's labels and `<prefix>gpus` annotation on its own Node, and renews
    its freshness Lease.

    Writes only on change: it remembers what it last applied and sends nothing while
    the desired set is the same. After an error, and every `resync_seconds`, it reads
    the Node and writes only if the Node drifted. An API error arms an exponential
    backoff and is raised as our APIError (the agent's job wrapper counts and logs it);
    the `kube-retry` job retries as soon as the backoff expires, so labels converge
    within one backoff cap of the API server's recovery.
    """

    name = "apiserver"

    def __init__(
        self,
        cfg: Config,
        creds: Credentials | None,
        metrics: AgentMetrics,
        *,
        client: KubeClient | None = None,
        clock: Callable[[], float] = time.time,
        rng: Callable[[], float] = random.random,
    ) -> None:
        k = cfg.kubernetes
        if client is None:
            if creds is None:
                raise SinkError("no Kubernetes credentials")
            client = KubeClient.from_credentials(creds, k.request_timeout_seconds)
        self.client = client
        self.node = cfg.node_name
        self.metrics = metrics
        self.clock = clock
        self.backoff = Backoff(1.0, k.backoff_max_seconds, rng)
        self.resync_s = k.resync_seconds
        self.lease_ns = k.lease_namespace
        self.lease_duration_s = k.lease_duration_seconds
        self.holder = f"{os.environ.get('POD_NAME') or socket.gethostname()}/{os.getpid()}"
        self.fresh: Callable[[], bool] = lambda: True
        self._lock = threading.Lock()
        self._desired: dict[str, dict[str, str]] | None = None
        self._applied: dict[str, dict[str, str]] | None = None
        self._verified_at = -float("inf")
        self._retry_at = -float("inf")
        self._node_uid: str | None = None
        self._acquired_at: float | None = None
        self._lease_failing = False

    # -- label sink interface ----------------------------------------------------------

    def set_freshness(self, fresh: Callable[[], bool]) -> None:
        """The Lease is renewed only while this says the agent's data is fresh."""
        self.fresh = fresh

    def apply(self, ls: LabelSet) -> bool:
        """Write if changed. Raises APIError (after arming the backoff) when it fails."""
        if not isinstance(ls.labels, Labels):
            raise SinkError("refusing labels that did not pass through sanitize_value")
        with self._lock:
            self._desired = ls.as_dict()
            return self._reconcile()

    def retry(self) -> bool:
        """Scheduled every second: does nothing unless a write is pending and due."""
        with self._lock:
            if self._desired is None or self._applied == self._desired:
                return False
            try:
                return self._reconcile()
            except APIError as e:
                logger.warning("{}", e)
                return False

    def jobs(self) -> list[tuple[str, Callable[[], Any], str]]:
        return [
            ("kube-retry", self.retry, "* * * * * *"),
            ("lease", self.heartbeat, renew_cron(self.lease_duration_s)),
        ]

    def close(self) -> None:
        self.client.close()

    # -- reconcile ---------------------------------------------------------------------

    def _reconcile(self) -> bool:
        now = self.clock()
        desired = self._desired
        assert desired is not None
        if now < self._retry_at:
            return False  # backing off; retry() picks it up when due
        if desired == self._applied and now - self._verified_at < self.resync_s:
            self._ok(now, "unchanged")
            return False
        try:
            if self._applied is None or desired == self._applied:
                # First write, after an error, or a periodic resync: read, and write
                # only if the Node drifted (a restarted agent does not rewrite it).
                node = self.client.get_node(self.node)
                self._node_uid = node.get("metadata", {}).get("uid")
                if in_sync(node, desired):
                    self._applied, self._verified_at = desired, now
                    self._ok(now, "unchanged")
                    return False
            result = self.client.apply_node(self.node, desired["labels"], desired["annotations"])
            self._node_uid = result.get("metadata", {}).get("uid", self._node_uid)
        except APIError as e:
            self._applied = None
            delay = self.backoff.next_delay()
            self._retry_at = now + delay
            self.metrics.node_writes.labels("error").inc()
            # Raised, not logged: the caller's job accounting logs it once and counts
            # it in poll_errors, and `run --once` exits non-zero.
            raise type(e)(
                f"node {self.node}: labels not written, retry in {delay:.1f}s: {e}", e.status
            ) from None
        if self.backoff.failures:
            logger.info(
                "node {}: labels written after {} failed attempt(s)",
                self.node,
                self.backoff.failures,
            )
        self._applied, self._verified_at = desired, now
        self._ok(now, "success")
        return True

    def _ok(self, now: float, result: str) -> None:
        self.backoff.reset()
        self._retry_at = -float("inf")
        self.metrics.node_writes.labels(result).inc()
        self.metrics.last_reconcile_timestamp_seconds.set(now)

    # -- freshness Lease ---------------------------------------------------------------

    def heartbeat(self) -> bool:
        """Renew the node's Lease: holder, duration, renewTime. Skipped while the data
        is stale or the Node's labels are not known to be current, so an expired Lease
        means "do not trust this node's labels and annotation"."""
        with self._lock:
            current = self._applied is not None and self._applied == self._desired
        if not current or not self.fresh():
            return False
        now = self.clock()
        if self._acquired_at is None:
            self._acquired_at = now
        spec = {
            "holderIdentity": self.holder,
            "leaseDurationSeconds": self.lease_duration_s,
            "acquireTime": micro_time(self._acquired_at),
            "renewTime": micro_time(now),
        }
        owner = None
        if self._node_uid:
            # Garbage-collected with the Node, like kubelet's lease.
            owner = {"apiVersion": "v1", "kind": "Node", "name": self.node, "uid": self._node_uid}
        try:
            self.client.apply_lease(self.lease_ns, self.node, spec, owner)
        except APIError as e:
            if not self._lease_failing:  # one line per outage, not one per renewal
                logger.warning("node {}: lease renewal failed: {}", self.node, e)
            self._lease_failing = True
            return False
        if self._lease_failing:
            logger.info("node {}: lease renewed again", self.node)
        self._lease_failing = False
        return True
