"""The healthy and unhealthy GPU counts: they change only when a GPU's health changes,
not with load. `gpu.unhealthy` is always present (0 on a healthy node) so that
`nodeSelector: {<prefix>gpu.unhealthy: "0"}` keeps pods off sick nodes."""

from __future__ import annotations

from gpudaemon.labels.base import RawLabels
from gpudaemon.labels.keys import GPU_HEALTHY, GPU_UNHEALTHY
from gpudaemon.model import Snapshot


class HealthLabeler:
    def labels(self, snap: Snapshot) -> RawLabels:
        if snap.inventory is None or not snap.samples:
            return {}
        healthy = sum(1 for s in snap.samples if s.healthy)
        return {GPU_HEALTHY: healthy, GPU_UNHEALTHY: len(snap.samples) - healthy}
