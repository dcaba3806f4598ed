"""The rebalancer's calls to the API server, each built here and nowhere else: the
policy/v1 Eviction (so every PodDisruptionBudget holds), its dry-run check, the Event
on the pod for every decision, and the reservation note on the pod for people.
KubeError comes back from `evict` for the caller to count; the others log it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from loguru import logger

from gpudaemon.cluster.reservations import RESERVED_NODE_ANNOTATION, RESERVED_UNTIL_ANNOTATION
from gpudaemon.errors import KubeError, KubeNotFoundError
from gpudaemon.kube.client import KubeClient
from gpudaemon.kube.lease import micro_time
from gpudaemon.rebalancer.planner import PodFacts

COMPONENT = "gpudaemon-rebalancer"
EVENT_REPEAT_S = 600.0  # the same Event for the same pod at most this often


def eviction_path(pod: PodFacts) -> str:
    return f"/api/v1/namespaces/{pod.namespace}/pods/{pod.name}/eviction"


def eviction_body(pod: PodFacts) -> dict[str, Any]:
    return {"apiVersion": "policy/v1", "kind": "Eviction",
            "metadata": {"name": pod.name, "namespace": pod.namespace}}  # fmt: skip


def event_body(
    pod: PodFacts, reason: str, message: str, warning: bool, instance: str, now: str
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{pod.name}.", "namespace": pod.namespace},
        "involvedObject": {"apiVersion": "v1", "kind": "Pod", "namespace": pod.namespace,
                           "name": pod.name, "uid": pod.uid},
        "reason": reason,
        "message": message[:1024],
        "type": "Warning" if warning else "Normal",
        "source": {"component": COMPONENT},
        "reportingComponent": COMPONENT,
        "reportingInstance": instance,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }  # fmt: skip


class Actions:
    """API calls about pods, for one replica (`identity` reports the Events)."""

    def __init__(
        self,
        kube: KubeClient,
        identity: str,
        clock: Callable[[], float],
        wall: Callable[[], float],
    ) -> None:
        self.kube, self.identity, self.clock, self.wall = kube, identity, clock, wall
        self.told: dict[tuple[str, str], float] = {}  # (pod uid, reason) -> last told

    def once(self, key: tuple[str, str]) -> bool:
        """True (and remembered) unless `key` was told within EVENT_REPEAT_S."""
        last = self.told.get(key)
        if last is not None and self.clock() - last < EVENT_REPEAT_S:
            return False
        self.told[key] = self.clock()
        return True

    def forget_told(self) -> None:
        """A dedupe entry is of no use past EVENT_REPEAT_S."""
        now = self.clock()
        self.told = {k: t for k, t in self.told.items() if now - t < EVENT_REPEAT_S}

    def evict(self, pod: PodFacts) -> None:
        """Evict through the Eviction API; KubeError (429: a PDB said no) as raised."""
        self.kube.request("POST", eviction_path(pod), eviction_body(pod))

    def eviction_refused(self, pod: PodFacts) -> str:
        """The Eviction API's own answer, without evicting (dryRun=All): "" when it would
        go ahead, "refused_pdb" for a PodDisruptionBudget, "api_error" otherwise."""
        try:
            self.kube.request(
                "POST", eviction_path(pod), eviction_body(pod), query={"dryRun": "All"}
            )
            return ""
        except KubeNotFoundError:
            return "api_error"  # gone since the snapshot: plan again next pass
        except KubeError as e:
            if e.status == 429:
                return "refused_pdb"
            logger.warning("rebalancer: eviction check for {}: {}", pod.key, e)
            return "api_error"

    def event(
        self, pod: PodFacts, reason: str, message: str, *, warning: bool = False, dedupe: str = ""
    ) -> bool:
        """An Event on the pod; the same (pod, dedupe key) at most every EVENT_REPEAT_S.
        False when this one was held back as a repeat."""
        if dedupe and not self.once((pod.uid, dedupe)):
            return False
        now = micro_time(self.wall())[:19] + "Z"
        body = event_body(pod, reason, message, warning, self.identity, now)
        try:
            self.kube.request("POST", f"/api/v1/namespaces/{pod.namespace}/events", body)
        except KubeError as e:
            logger.debug("rebalancer: event for {}: {}", pod.key, e)
        return True

    def mirror(self, pod: PodFacts, node: str, until: float) -> None:
        """The reservation on the pod too, for people (`kubectl describe`); nothing
        reads it back, and a failure to write it changes nothing."""
        ann = {RESERVED_NODE_ANNOTATION: node, RESERVED_UNTIL_ANNOTATION: f"{until:.0f}"}
        body = {"metadata": {"annotations": ann}}
        try:
            self.kube.request("PATCH", f"/api/v1/namespaces/{pod.namespace}/pods/{pod.name}",
                              body, content_type="application/merge-patch+json")  # fmt: skip
        except KubeError as e:
            logger.debug("rebalancer: reservation note on {}: {}", pod.key, e)
