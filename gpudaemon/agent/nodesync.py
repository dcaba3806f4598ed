"""What the agent's Node sink holds (agent/nodelabels.py): the state its label
reconcile, Node watch and freshness Lease share, and the checks of a Node against what
we applied (managedFields ownership, the Node's UID)."""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from loguru import logger

from gpudaemon.agent.nodehealth import NodeHealthWriter
from gpudaemon.agent.nodewatch import NodeWatch, resource_version
from gpudaemon.errors import SinkError
from gpudaemon.kube.backoff import Backoff
from gpudaemon.kube.client import FIELD_MANAGER, Credentials, KubeClient
from gpudaemon.kube.lease import LeaseRenewer
from gpudaemon.labels import GpuHealth
from gpudaemon.labels.sanitize import DEFAULT_PREFIX
from gpudaemon.labels.sharing import is_sharing_key
from gpudaemon.logsetup import LogLimiter

FRESH_SINCE = "fresh-since"

if TYPE_CHECKING:
    from gpudaemon.agent.metrics.selfmetrics import AgentMetrics
    from gpudaemon.config import KubernetesConfig


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


def set_by_others(
    node: Mapping[str, Any], keys: Callable[[str], bool], manager: str = FIELD_MANAGER
) -> frozenset[str]:
    """The Node's labels matching `keys` that another field manager set (and so owns,
    alone or with us), from managedFields."""
    out: set[str] = set()
    labels = node.get("metadata", {}).get("labels") or {}
    for entry in node.get("metadata", {}).get("managedFields") or []:
        if not isinstance(entry, Mapping) or entry.get("manager") == manager:
            continue
        meta = (entry.get("fieldsV1") or {}).get("f:metadata", {})
        f_labels = meta.get("f:labels", {}) if isinstance(meta, Mapping) else {}
        if not isinstance(f_labels, Mapping):
            continue
        out |= {k[2:] for k in f_labels if k.startswith("f:") and keys(k[2:])}
    return frozenset(k for k in out if k in labels)


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


class NodeSinkState:
    """The state of NodeLabelSink (and of the Lease heartbeat it builds on), with the
    small checks both use."""

    def __init__(
        self,
        k: KubernetesConfig,
        node: str,
        creds: Credentials | None,
        metrics: AgentMetrics,
        *,
        client: KubeClient | None = None,
        clock: Callable[[], float] = time.time,
        rng: Callable[[], float] = random.random,
        prefix: str = DEFAULT_PREFIX,
        taint_unhealthy: bool = False,
    ) -> None:
        if client is None:
            if creds is None:
                raise SinkError("no Kubernetes credentials")
            client = KubeClient.from_credentials(
                creds, k.request_timeout_seconds, k.connect_timeout_seconds
            )
        self.client = client
        self.node = node
        self.metrics = metrics
        self.clock = clock
        self.backoff = Backoff(1.0, k.backoff_max_seconds, rng)
        self.resync_s = k.resync_seconds
        self.lease = LeaseRenewer(
            client,
            k.lease_namespace,
            self.node,
            k.lease_duration_seconds,
            holder=f"{k.holder_identity}/{os.getpid()}",
            clock=clock,
        )
        self.health = NodeHealthWriter(client, node, prefix, taint=taint_unhealthy, clock=clock)
        self._unhealthy: tuple[GpuHealth, ...] = ()  # unhealthy and degraded GPUs
        self._gpus = 0
        self.fresh: Callable[[], bool] = lambda: True
        # Called with the Node whenever a reconcile reads it in full (the agent seeds
        # its fault record from it when the read at start-up failed).
        self.on_read: Callable[[Mapping[str, Any]], None] | None = None
        # Told of every view of the Node the watch brings (the GPU reset reads its
        # grant there), outside the sink's lock.
        self.node_observers: list[Callable[[Mapping[str, Any]], None]] = []
        self._lock = threading.Lock()
        # GPU-sharing labels (labels/sharing.py) that another manager set on the Node:
        # theirs, never taken over (with the `nvidia.com/` prefix the device plugin's
        # time-slicing or MPS config sets them through GFD). `_wanted` is what the
        # labelers asked for; `_desired` is that without them.
        self._sharing_key: Callable[[str], bool] = lambda k: is_sharing_key(k, prefix)
        self._yielded: frozenset[str] = frozenset()
        self._wanted: dict[str, str] = {}
        self._desired: dict[str, dict[str, str]] | None = None
        self._applied: dict[str, dict[str, str]] | None = None
        self._verified_at = -float("inf")
        self._retry_at = -float("inf")
        self._node_uid: str | None = None  # the Node our labels were written to
        self._lease_uid: str | None = None  # the owner in our last Lease renewal
        self._label_log = LogLimiter()  # one line per outage, one when it ends
        self._lease_log = LogLimiter()
        # A renewal is owed: none yet for the Node the labels went to, or the last one
        # failed. kube-retry pays it within a second (with its own backoff), so a new
        # or restarted agent, a re-created Node or a lost Lease do not wait for the
        # next renewal tick (minutes) before the extender trusts the node.
        self._lease_owed = True
        # `<prefix>fresh-since`: written once, just after a renewal that makes the node
        # fresh again (this process's first, or the first after the Lease lapsed). A
        # Lease is not a kube-scheduler event; this Node update is, so GPU pods the
        # extender turned away as "stale" are retried at once instead of waiting for
        # the scheduler's periodic flush of unschedulable pods (minutes).
        self._fresh_key = prefix + FRESH_SINCE
        self._fresh_since: str | None = None
        self._lease_ok_at = -float("inf")
        self._lease_backoff = Backoff(1.0, k.backoff_max_seconds, rng)
        self._lease_retry_at = -float("inf")
        # The Node watch (started by `start`): its last view of the Node (None: gone),
        # and the newest resourceVersion we wrote or read, so a view from before our
        # own write is not taken for someone else's edit.
        self.watch: NodeWatch | None = None
        self._view: Mapping[str, Any] | None = None
        self._known_rv: int | None = None
        # Repairs of edits made under us, spaced out: a controller that keeps removing
        # our labels is not answered with a write per removal.
        self._drift_backoff = Backoff(1.0, k.backoff_max_seconds, rng)
        self._drift_at = -float("inf")

    @property
    def client(self) -> KubeClient:
        return self._client

    @client.setter
    def client(self, c: KubeClient) -> None:
        self._client = c
        if hasattr(self, "health"):
            self.health.client = c

    def _note(self, obj: Any) -> None:
        """Remember the newest resourceVersion we have written or read, and which
        sharing labels others have set on the Node."""
        rv = resource_version(obj) if isinstance(obj, Mapping) else None
        if rv is not None and (self._known_rv is None or rv > self._known_rv):
            self._known_rv = rv
        if isinstance(obj, Mapping) and "managedFields" in (obj.get("metadata") or {}):
            yielded = set_by_others(obj, self._sharing_key)
            if yielded != self._yielded:
                if yielded - self._yielded:
                    logger.info(
                        "node {}: {} set by another manager: leaving them to it",
                        self.node,
                        ", ".join(sorted(yielded - self._yielded)),
                    )
                self._yielded = yielded
                if self._desired is not None:
                    self._desired = {
                        "labels": self._own(self._wanted),
                        "annotations": self._desired["annotations"],
                    }

    def _own(self, labels: Mapping[str, str]) -> dict[str, str]:
        """The labels we write: all we want but the sharing labels others set."""
        return {k: v for k, v in labels.items() if k not in self._yielded}

    def _watch_live(self) -> bool:
        return self.watch is not None and self.watch.live

    def _same_node(self, node: Mapping[str, Any]) -> bool:
        """False, with one log line, when the Node's UID is not the one we wrote to."""
        uid = _uid(node)
        if self._node_uid is None or uid == self._node_uid:
            return True
        logger.warning(
            "node {}: the Node was re-created (uid {} -> {}): writing its labels again and "
            "re-owning its Lease",
            self.node,
            self._node_uid,
            uid,
        )
        self._node_uid = None
        self.health.forget()
        return False

    def _ok(self, now: float, result: str) -> None:
        self.backoff.reset()
        self._retry_at = -float("inf")
        self.metrics.node_writes.labels(result).inc()
        self.metrics.last_reconcile_timestamp_seconds.set(now)


def _uid(obj: Mapping[str, Any]) -> str | None:
    uid = (obj.get("metadata") or {}).get("uid")
    return uid if isinstance(uid, str) and uid else None
