"""Events about a Node (core/v1, in the `default` namespace where kubelet writes the
Node's own): `kubectl describe node` shows them, and event exporters ship them."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from loguru import logger

from gpudaemon.errors import KubeError
from gpudaemon.kube.client import KubeClient
from gpudaemon.kube.lease import micro_time

NODE_EVENT_NAMESPACE = "default"


def node_event_body(
    node: str, uid: str, reason: str, message: str, warning: bool, component: str, instance: str,
    now: float,
) -> dict[str, Any]:  # fmt: skip
    stamp = micro_time(now)[:19] + "Z"
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{node}.", "namespace": NODE_EVENT_NAMESPACE},
        "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": node, "uid": uid or node},
        "reason": reason,
        "message": message[:1024],
        "type": "Warning" if warning else "Normal",
        "source": {"component": component, "host": node},
        "reportingComponent": component,
        "reportingInstance": instance,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


class NodeEvents:
    """Posts Events on one Node; a failure is one log line, never raised (the Event
    tells people; the metrics and the log say the same)."""

    def __init__(
        self,
        client: KubeClient,
        node: str,
        component: str,
        uid: Callable[[], str | None] = lambda: None,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.client, self.node, self.component = client, node, component
        self.uid, self.wall = uid, wall

    def post(self, reason: str, message: str, warning: bool = False) -> bool:
        body = node_event_body(self.node, self.uid() or "", reason, message, warning,
                               self.component, self.node, self.wall())  # fmt: skip
        try:
            self.client.request("POST", f"/api/v1/namespaces/{NODE_EVENT_NAMESPACE}/events", body)
            return True
        except KubeError as e:
            logger.warning("node {}: Event {} not written: {}", self.node, reason, e)
            return False
