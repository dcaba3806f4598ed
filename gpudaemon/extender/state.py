"""What scoring sees: an immutable per-node summary and the pod's shape.

Both are plain values so filtering and the policies stay pure functions, tested as
tables, and a request reads a consistent view with no locks.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PodShape:
    """What a pod asks for, by kube-scheduler's request rule (see `podspec`)."""

    gpus: int
    cpu_milli: int = 0
    memory_bytes: int = 0
    # GPU products the pod may run on (its required node affinity on `gpu.product`);
    # None means any.
    gpu_models: frozenset[str] | None = None

    def fits_model(self, model: str) -> bool:
        return self.gpu_models is None or model in self.gpu_models


@dataclass(frozen=True, slots=True)
class NodeState:
    """One GPU node as the extender's caches see it, including assumed placements."""

    name: str
    gpu_model: str = ""  # the agent's `gpu.product` label
    gpus_allocatable: int = 0
    gpus_requested: int = 0  # bound non-terminal pods + assumed pods
    gpus_unhealthy: int = 0  # `gpu.count` - `gpu.healthy`, from the agent's labels
    cpu_allocatable_milli: int = 0
    cpu_requested_milli: int = 0
    memory_allocatable_bytes: int = 0
    memory_requested_bytes: int = 0
    utilization_ratio: float | None = None  # mean over GPUs, from the `gpus` annotation
    has_agent_labels: bool = True

    @property
    def gpus_free(self) -> int:
        """Healthy free GPUs. An unhealthy GPU may be one a pod holds or a free one;
        counting it as free would overcommit a dead device, so it is subtracted."""
        return max(0, self.gpus_allocatable - self.gpus_requested - self.gpus_unhealthy)

    @property
    def cpu_free_milli(self) -> int:
        return max(0, self.cpu_allocatable_milli - self.cpu_requested_milli)

    @property
    def memory_free_bytes(self) -> int:
        return max(0, self.memory_allocatable_bytes - self.memory_requested_bytes)

    def can_host(self, pod: PodShape) -> bool:
        """GPU count, CPU, memory and model all fit (the whole-GPU view)."""
        return (
            pod.gpus <= self.gpus_free
            and pod.cpu_milli <= self.cpu_free_milli
            and pod.memory_bytes <= self.memory_free_bytes
            and pod.fits_model(self.gpu_model)
        )

    def with_placed(self, pod: PodShape) -> NodeState:
        """The node after the pod lands on it."""
        from dataclasses import replace

        return replace(
            self,
            gpus_requested=self.gpus_requested + pod.gpus,
            cpu_requested_milli=self.cpu_requested_milli + pod.cpu_milli,
            memory_requested_bytes=self.memory_requested_bytes + pod.memory_bytes,
        )
