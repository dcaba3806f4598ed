"""MIG labels: whether the GPUs can be partitioned, and whether they are."""

from __future__ import annotations

from gpudaemon.labels.base import RawLabels
from gpudaemon.model import Snapshot


class MigLabeler:
    def labels(self, snap: Snapshot) -> RawLabels:
        inv = snap.inventory
        if inv is None or not inv.gpus:
            return {}
        return {
            "mig.capable": any(g.mig_capable for g in inv.gpus),
            "mig.enabled": any(g.mig_enabled for g in inv.gpus),
        }
