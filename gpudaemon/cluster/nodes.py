"""Reading a Node object into a `NodeState`, and the bookkeeping of Nodes whose
agent-written values cannot be read (kept as nodes with no data, logged and counted
once per node and value). ClusterState holds its lock around every call here."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from loguru import logger

from gpudaemon.cluster.podspec import GPU_RESOURCE, MIG_RESOURCE_PREFIX, quantity
from gpudaemon.cluster.state import NodeState
from gpudaemon.labels.annotations import count_label, decode_gpus
from gpudaemon.labels.keys import GPU_COUNT, GPU_HEALTHY, GPU_UNHEALTHY, GPUS_ANNOTATION

Obj = Mapping[str, Any]
_COUNT_LABELS = (GPU_COUNT, GPU_HEALTHY, GPU_UNHEALTHY)
_MAX_QUANTITY = float(2**62)  # beyond any node; keeps `* 1000` and int() finite


def read_node(
    name: str,
    meta: Obj,
    obj: Obj,
    prefix: str,
    product_label: str,
    *,
    agent: bool = True,
    bad: str = "",
) -> NodeState:
    """The node's state; BadValueError when an agent-written value is unreadable.
    With `agent` False (after one was), the Node's own figures alone, as no data."""
    labels = meta.get("labels") or {}
    alloc = (obj.get("status") or {}).get("allocatable") or {}
    p = prefix
    has_agent = (p + GPU_COUNT) in labels
    count = healthy = unhealthy = 0
    utilization, degraded, sick = None, 0, frozenset[str]()
    if agent and has_agent:
        count = count_label(labels[p + GPU_COUNT], GPU_COUNT)
        healthy = _count(labels, p + GPU_HEALTHY, count)
        # `gpu.unhealthy` counts physical GPUs; under the single MIG strategy
        # `gpu.count` counts MIG devices, so count - healthy would be wrong there.
        unhealthy = _count(labels, p + GPU_UNHEALTHY, max(0, count - healthy))
    if agent:
        ann = (meta.get("annotations") or {}).get(p + GPUS_ANNOTATION)
        utilization, degraded, sick = _gpu_facts(ann)
    mig = tuple(
        sorted(
            (k.removeprefix(MIG_RESOURCE_PREFIX), n)
            for k, v in alloc.items()
            if isinstance(k, str) and k.startswith(MIG_RESOURCE_PREFIX) and (n := int(_q(v))) > 0
        )
    )
    return NodeState(
        name=name,
        gpu_model=str(labels.get(product_label, "")),
        gpus_allocatable=int(_q(alloc.get(GPU_RESOURCE))),
        gpus_unhealthy=max(0, unhealthy),
        mig_allocatable=mig,
        cpu_allocatable_milli=int(_q(alloc.get("cpu")) * 1000),
        memory_allocatable_bytes=int(_q(alloc.get("memory"))),
        utilization_ratio=utilization,
        gpus_degraded_free=degraded,
        unhealthy_uuids=sick,
        has_agent_labels=has_agent,
        gpus_total=count,
        bad_data=bad,
    )


def agent_values_id(meta: Obj, prefix: str) -> int:
    """One number for the agent's values on the Node, to tell a new bad value from
    the same one sent again (no repr: that could recurse)."""
    labels, ann = meta.get("labels") or {}, meta.get("annotations") or {}
    values = [labels.get(prefix + k) for k in _COUNT_LABELS] + [ann.get(prefix + GPUS_ANNOTATION)]
    return hash(tuple(v if isinstance(v, str) else type(v).__name__ for v in values))


class BadNodes:
    """Nodes whose agent data is unreadable (never fresh while listed), and the
    (key, value) last logged for each, so a value is logged and counted once. Not
    locked: ClusterState holds its lock around every call."""

    def __init__(self) -> None:
        self.reasons: dict[str, str] = {}  # node -> why its data is unreadable
        self._seen: dict[str, tuple[str, int]] = {}
        self.values: dict[str, int] = {}  # key -> unreadable values seen

    def note_bad(self, name: str, key: str, value_id: int | None, reason: str) -> None:
        """The node has no data until it writes a readable value. Logged and counted
        once per node and value, not per event: a node's Lease renewals and label
        writes re-send the same bad value every few minutes."""
        self.reasons[name] = f"{key}: {reason}"
        seen = (key, value_id if value_id is not None else hash(reason))
        if self._seen.get(name) == seen:
            return
        self._seen[name] = seen
        self.values[key] = self.values.get(key, 0) + 1
        logger.warning(
            "node {}: ignoring its {} ({}); the node has no agent data until it writes a"
            " readable value",
            name or "(unnamed)", key, reason,
        )  # fmt: skip

    def note_good(self, name: str) -> None:
        self.reasons.pop(name, None)
        if self._seen.pop(name, None) is not None:
            logger.info("node {}: its agent data is readable again", name)

    def forget(self, name: str) -> None:
        """The Node is gone: a new one of the same name is logged afresh."""
        self.reasons.pop(name, None)
        self._seen.pop(name, None)

    def keep_only(self, names: set[str]) -> None:
        for name in set(self._seen) - names:
            self._seen.pop(name, None)


def _q(v: object) -> float:
    """An allocatable quantity (kubelet writes them); unreadable or absurd reads as 0."""
    if v is None:
        return 0.0
    try:
        q = quantity(v)
    except ValueError:
        return 0.0
    return q if 0.0 <= q <= _MAX_QUANTITY else 0.0


def _count(labels: Obj, key: str, default: int) -> int:
    """An optional count label; absent is `default`, unreadable is BadValueError."""
    v = labels.get(key)
    return default if v is None else count_label(v, key.rpartition("/")[2])


def _gpu_facts(annotation: object) -> tuple[float | None, int, frozenset[str]]:
    """(mean `utilization_pct` as a ratio, degraded GPUs no pod holds, UUIDs of the
    unhealthy GPUs) of the agent's
    `gpus` annotation, read with its own bounded decoder (next to its encoder, which
    checks `state`). Absent: (None, 0); unreadable: BadValueError."""
    if annotation is None:
        return None, 0, frozenset()
    gpus = decode_gpus(annotation)
    vals = [g.utilization_pct for g in gpus if g.utilization_pct is not None]
    degraded = sum(1 for g in gpus if g.state == "degraded" and not g.pods)
    sick = frozenset(g.uuid for g in gpus if not g.healthy)
    return (sum(vals) / len(vals) / 100.0 if vals else None), degraded, sick
