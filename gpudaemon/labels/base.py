"""The Labeler interface: one small labeler per concern, merged in a fixed order."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Protocol

from gpudaemon.model import GpuInfo, NodeInventory, Snapshot

RawLabels = Mapping[str, str | int | bool]


class Labeler(Protocol):
    def labels(self, snap: Snapshot) -> RawLabels: ...


def merge(labelers: Sequence[Labeler], snap: Snapshot) -> dict[str, str | int | bool]:
    """Later labelers win on a clash, so the order is part of the contract."""
    out: dict[str, str | int | bool] = {}
    for labeler in labelers:
        out.update(labeler.labels(snap))
    return out


def primary_gpus(inv: NodeInventory) -> list[GpuInfo]:
    """The GPUs of the node's most common model (ties: the lowest index).

    Product-specific labels describe these, so a mixed node's labels stay consistent
    with each other (GPU Feature Discovery describes the first GPU instead).
    """
    known = [g for g in inv.gpus if g.name != "unknown"]
    if not known:
        return []
    counts = Counter(g.name for g in known)
    best = max(counts.values())
    name = next(g.name for g in known if counts[g.name] == best)
    return [g for g in known if g.name == name]
