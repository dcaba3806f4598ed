"""GPU health where kubectl and the default scheduler see it: the Node condition
`GPUHealthy` (node-problem-detector style) and, opt-in, the taint
`<prefix>gpu-unhealthy:NoSchedule`. Both are written only when they change.

The condition follows the verdict (health/verdict.py): False (`GPUUnhealthy`) while any
GPU is unhealthy; True while the GPUs are schedulable, `AllGPUsHealthy` or, with a GPU
degraded, `GPUDegraded` (degraded GPUs are schedulable, so the node is not marked
unhealthy for them). The message names each GPU's state, reason and action. Degraded
does not flap: the verdict holds it (a clock event 5 minutes after the last poll that
saw it, NVLink errors 10 minutes, growing remaps an hour), and only a change of the
condition is written. The taint is for unhealthy GPUs only.

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
from gpudaemon.labels import GpuHealth

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


# The condition's reasons: fixed words that tools match on; the message has the detail.
HEALTHY_REASON = "AllGPUsHealthy"
DEGRADED_REASON = "GPUDegraded"
UNHEALTHY_REASON = "GPUUnhealthy"

# What the GPUs' verdicts are, one entry per unhealthy or degraded GPU; a bare
# (index, reason) pair is an unhealthy GPU whose action is not known.
Verdicts = Sequence[GpuHealth | tuple[int, str]]


def _entries(verdicts: Verdicts) -> list[GpuHealth]:
    return sorted(v if isinstance(v, GpuHealth) else GpuHealth(*v) for v in verdicts)


def _describe(g: GpuHealth) -> str:
    """`GPU 3: row remap pending (unhealthy, action reset_gpu)`: it starts as the message
    did before the verdict (`GPU 3: xid 79`), so what matched that still matches."""
    action = f", action {g.action}" if g.action else ""
    return f"GPU {g.index}: {g.reason} ({g.state}{action})"


def _unhealthy(verdicts: Verdicts) -> bool:
    return any(g.state == "unhealthy" for g in _entries(verdicts))


def condition_for(verdicts: Verdicts, gpus: int) -> Condition:
    """The condition for the node's unhealthy and degraded GPUs."""
    entries = _entries(verdicts)
    bad = [g for g in entries if g.state == "unhealthy"]
    degraded = [g for g in entries if g.state != "unhealthy"]
    if not entries:
        return Condition("True", HEALTHY_REASON, f"all {gpus} GPU(s) healthy")
    parts = []
    if bad:
        parts.append(f"{len(bad)} of {gpus} GPU(s) unhealthy: " + "; ".join(map(_describe, bad)))
    if degraded:
        parts.append(
            f"{len(degraded)} of {gpus} GPU(s) degraded (schedulable, watched): "
            + "; ".join(map(_describe, degraded))
        )
    message = ". ".join(parts)
    if len(message) > _MAX_MESSAGE:
        message = message[: _MAX_MESSAGE - 3] + "..."
    if bad:
        return Condition("False", UNHEALTHY_REASON, message)
    return Condition("True", DEGRADED_REASON, message)


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

    def pending(self, verdicts: Verdicts, gpus: int) -> bool:
        want = (condition_for(verdicts, gpus), self.taint and _unhealthy(verdicts))
        return self._written != want

    def sync(self, verdicts: Verdicts, gpus: int) -> bool:
        """Write what changed; True if anything was written. Raises KubeError."""
        cond = condition_for(verdicts, gpus)
        tainted = self.taint and _unhealthy(verdicts)
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
