"""From cache to labels and annotations: labelers merged in a fixed order, then sanitised."""

from __future__ import annotations

from dataclasses import dataclass, field

from gpudaemon.labels.annotations import GpuStateAnnotator, Quantization
from gpudaemon.labels.base import Labeler, merge
from gpudaemon.labels.driver import DriverLabeler
from gpudaemon.labels.health import HealthLabeler
from gpudaemon.labels.inventory import InventoryLabeler
from gpudaemon.labels.mig import MigLabeler
from gpudaemon.labels.sanitize import DEFAULT_PREFIX, Labels, sanitize_value
from gpudaemon.labels.sharing import SharingLabeler
from gpudaemon.model import PodMap, Snapshot


@dataclass(frozen=True, order=True)
class GpuHealth:
    """One GPU that is not healthy, for the Node condition: its verdict (health/verdict.py).
    `(index, reason)` alone reads as unhealthy with no action known (an older caller)."""

    index: int
    reason: str
    state: str = "unhealthy"  # unhealthy | degraded
    action: str = ""  # none | watch | drain | reset_gpu | reboot_node | replace; "": unknown


@dataclass(frozen=True)
class LabelSet:
    """What the agent wants on its Node: its own labels and annotations, nothing else."""

    labels: Labels
    annotations: dict[str, str] = field(default_factory=dict)
    # Each unhealthy or degraded GPU, and the GPU count: for the Node condition and the
    # optional taint (unhealthy ones only), which the API-server sink writes beside the
    # labels.
    verdicts: tuple[GpuHealth, ...] = ()
    gpus: int = 0

    def as_dict(self) -> dict[str, dict[str, str]]:
        return {"labels": dict(self.labels), "annotations": dict(self.annotations)}


class NodeLabeler:
    """Owns the labeler order and the annotator's hysteresis state."""

    def __init__(
        self,
        prefix: str = DEFAULT_PREFIX,
        q: Quantization | None = None,
        mig_strategy: str = "none",
    ) -> None:
        self.prefix = prefix
        self.labelers: tuple[Labeler, ...] = (
            InventoryLabeler(),
            DriverLabeler(),
            SharingLabeler(),
            MigLabeler(mig_strategy),  # after these: single rewrites gpu.*
            HealthLabeler(),
        )
        self.annotator = GpuStateAnnotator(prefix, q)

    def build(self, snap: Snapshot, pods: PodMap | None = None) -> LabelSet:
        """`pods` (device id -> holder) marks the MIG devices a pod holds."""
        return LabelSet(
            labels=Labels(self.prefix, merge(self.labelers, snap)),
            annotations=self.annotator.annotations(snap, pods),
            verdicts=tuple(
                GpuHealth(
                    s.index, s.health_reason or s.health_state, s.health_state, s.health_action
                )
                for s in snap.samples
                if s.health_state != "healthy"
            ),
            gpus=len(snap.samples),
        )


__all__ = ["GpuHealth", "LabelSet", "Labels", "NodeLabeler", "Quantization", "sanitize_value"]
