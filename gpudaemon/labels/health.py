"""The healthy-GPU count: it changes only when a GPU's health changes, not with load."""

from __future__ import annotations

from gpudaemon.labels.base import RawLabels
from gpudaemon.model import Snapshot


class HealthLabeler:
    def labels(self, snap: Snapshot) -> RawLabels:
        if snap.inventory is None or not snap.samples:
            return {}
        return {"gpu.healthy": sum(1 for s in snap.samples if s.healthy)}
