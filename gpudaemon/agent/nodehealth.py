"""GPU health where kubectl and the default scheduler see it: the Node condition
`GPUHealthy` (node-problem-detector style) and, opt-in, the taint
`<prefix>gpu-unhealthy:NoSchedule`. Both are written only when they change.

Lists that server-side apply would take over whole are patched entry by entry: the
condition by a strategic-merge patch of the status (conditions merge by type), the
taint by a JSON patch guarded by the Node's resourceVersion, so another writer's
taints are never lost.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from gpudaemon.kube.lease import micro_time

CONDITION_TYPE = "GPUHealthy"
TAINT_SUFFIX = "gpu-unhealthy"
TAINT_EFFECT = "NoSchedule"
_MAX_MESSAGE = 1024  # a condition message is for people; keep it one short line


class HealthClient(Protocol):
    def get_node(self, name: str, cached: bool = False) -> dict[str, Any]: ...

    def patch_node(self, name: str, patch: Mapping[str, Any], status: bool = False) -> Any: ...

    def json_patch_node(self, name: str, ops: list[dict[str, Any]]) -> Any: ...


@dataclass(frozen=True)
class Condition:
    status: str  # "True" | "False"
    reason: str
    message: str


def condition_for(unhealthy: Sequence[tuple[int, str]], gpus: int) -> Condition:
    """The condition for the node's unhealthy GPUs, as (index, reason) pairs."""
    if not unhealthy:
        return Condition("True", "AllGPUsHealthy", f"all {gpus} GPU(s) healthy")
    parts = "; ".join(f"GPU {i}: {why}" for i, why in sorted(unhealthy))
    message = f"{len(unhealthy)} of {gpus} GPU(s) unhealthy: {parts}"
    if len(message) > _MAX_MESSAGE:
        message = message[: _MAX_MESSAGE - 3] + "..."
    return Condition("False", "GPUUnhealthy", message)


def current_condition(node: Mapping[str, Any]) -> Condition | None:
    for c in (node.get("status") or {}).get("conditions") or []:
        if isinstance(c, Mapping) and c.get("type") == CONDITION_TYPE:
            return Condition(str(c.get("status")), str(c.get("reason")), str(c.get("message")))
    return None


def has_taint(node: Mapping[str, Any], key: str) -> bool:
    return any(
        isinstance(t, Mapping) and t.get("key") == key
        for t in (node.get("spec") or {}).get("taints") or []
    )


class NodeHealthWriter:
    """Keeps the condition (and the optional taint) equal to the agent's view.

    It remembers what it wrote; the first sync, and the first after a failure or a
    re-created Node, reads the Node (from the API server's cache) so that a restarted
    agent rewrites nothing that is already right."""

    def __init__(
        self,
        client: HealthClient,
        node: str,
        prefix: str,
        *,
        taint: bool = False,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.client = client
        self.node = node
        self.taint_key = prefix + TAINT_SUFFIX
        self.taint = taint
        self.clock = clock
        # What the Node holds, as far as we know: (condition, tainted); None: unknown.
        self._written: tuple[Condition | None, bool] | None = None
        # The Node's version after our last write: the Node watch ignores older views.
        self.last_write: Mapping[str, Any] | None = None

    def forget(self) -> None:
        """The Node may differ from what we wrote (error, re-created Node): read it
        before the next write."""
        self._written = None

    def seen(self, node: Mapping[str, Any]) -> None:
        """The Node as just read by the label reconcile: no second read needed."""
        self._written = (current_condition(node), has_taint(node, self.taint_key))

    def pending(self, unhealthy: Sequence[tuple[int, str]], gpus: int) -> bool:
        want = (condition_for(unhealthy, gpus), self.taint and bool(unhealthy))
        return self._written != want

    def sync(self, unhealthy: Sequence[tuple[int, str]], gpus: int) -> bool:
        """Write what changed; True if anything was written. Raises KubeError."""
        cond = condition_for(unhealthy, gpus)
        tainted = self.taint and bool(unhealthy)
        if self._written == (cond, tainted):
            return False
        wrote = False
        if self._written is None:
            node = self.client.get_node(self.node, cached=True)
            have_cond, have_taint = current_condition(node), has_taint(node, self.taint_key)
        else:
            have_cond, have_taint = self._written
        if have_cond != cond:
            changed = have_cond is None or have_cond.status != cond.status
            self._write_condition(cond, transition=changed)
            wrote = True
        # Only an opted-in agent adds the taint; any agent removes its own taint (the
        # option was switched off while a GPU was sick).
        if have_taint != tainted:
            self._write_taint(tainted)
            wrote = True
        self._written = (cond, tainted)
        return wrote

    def _write_condition(self, cond: Condition, transition: bool) -> None:
        now = micro_time(self.clock()).split(".")[0] + "Z"  # a Time, not a MicroTime
        entry: dict[str, Any] = {
            "type": CONDITION_TYPE,
            "status": cond.status,
            "reason": cond.reason,
            "message": cond.message,
            "lastHeartbeatTime": now,
        }
        if transition:
            entry["lastTransitionTime"] = now
        out = self.client.patch_node(self.node, {"status": {"conditions": [entry]}}, status=True)
        self.last_write = out if isinstance(out, Mapping) else None

    def _write_taint(self, tainted: bool) -> None:
        node = self.client.get_node(self.node)  # current, for the resourceVersion guard
        rv = str((node.get("metadata") or {}).get("resourceVersion", ""))
        taints = [
            t
            for t in (node.get("spec") or {}).get("taints") or []
            if isinstance(t, Mapping) and t.get("key") != self.taint_key
        ]
        if tainted:
            taints.append({"key": self.taint_key, "effect": TAINT_EFFECT})
        ops: list[dict[str, Any]] = [
            {"op": "test", "path": "/metadata/resourceVersion", "value": rv},
            {"op": "add", "path": "/spec/taints", "value": taints},
        ]
        out = self.client.json_patch_node(self.node, ops)
        self.last_write = out if isinstance(out, Mapping) else None
