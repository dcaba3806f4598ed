"""What scoring sees: an immutable per-node summary and the pod's shape.

Both are plain values so filtering and the policies stay pure functions, tested as
tables, and a request reads a consistent view with no locks.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(frozen=True, slots=True)
class PodShape:
    """What a pod asks for, by kube-scheduler's request rule (see `podspec`)."""

    gpus: int
    cpu_milli: int = 0
    memory_bytes: int = 0
    # GPU products the pod may run on (its required node affinity on `gpu.product`);
    # None means any.
    gpu_models: frozenset[str] | None = None
    # MIG devices asked for (mixed strategy): sorted (profile, count), e.g.
    # (("1g.10gb", 2),) for nvidia.com/mig-1g.10gb: 2.
    mig: tuple[tuple[str, int], ...] = ()
    # Of the above, what the pod's DRA claims not yet allocated ask for, per claim:
    # (claim key, GPUs, MIG devices). Not part of the shape's identity (the policies
    # memoize scores by shape): it tells the assumption which allocations to wait for.
    dra: tuple[tuple[str, int, tuple[tuple[str, int], ...]], ...] = field(default=(), compare=False)

    def fits_model(self, model: str) -> bool:
        return self.gpu_models is None or model in self.gpu_models

    @property
    def wants_gpus(self) -> bool:
        """Whether the extender judges this pod: it asks for GPUs or MIG devices."""
        return self.gpus > 0 or bool(self.mig)


MigCounts = tuple[tuple[str, int], ...]  # sorted (profile, count), hashable


def add_mig(a: MigCounts, b: MigCounts, sign: int = 1) -> MigCounts:
    out = dict(a)
    for p, n in b:
        out[p] = out.get(p, 0) + sign * n
    return tuple(sorted((p, n) for p, n in out.items() if n))


@dataclass(frozen=True, slots=True)
class NodeState:
    """One GPU node as the extender's caches see it, including assumed placements.

    The free amounts are computed once, at construction: a request reads them for
    every node (5,000 per request), and a state lives until its node changes."""

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
    gpus_total: int = 0  # the agent's `gpu.count` (0: no agent labels)
    # MIG devices by profile: allocatable nvidia.com/mig-<p>, and requested by bound and
    # assumed pods (both sorted (profile, count)).
    mig_allocatable: MigCounts = ()
    mig_requested: MigCounts = ()
    # Of the requested: what only this extender's assumptions hold (pods it ranked but
    # has not seen bound). The filter leaves them out: kube-scheduler's own cache counts
    # its in-flight pods exactly (its NodeResourcesFit filter runs first), while an
    # assumption can outlive its pod's placement (a gang rejected at Permit), and
    # counting it would turn away pods from GPUs that are free. Ranking counts them.
    gpus_assumed: int = 0
    mig_assumed: MigCounts = ()
    # Why the agent's labels or annotation could not be read ("" when they could): such
    # a node has no data, is never fresh, and /filter says so (issue 28).
    bad_data: str = ""
    # UUIDs of the GPUs the agent reports unhealthy (its `gpus` annotation): a DRA
    # device both tainted and unhealthy is subtracted once (clusterstate folds DRA in).
    unhealthy_uuids: frozenset[str] = frozenset()
    # Degraded GPUs (the agent's verdict: schedulable, but watched) that no pod holds,
    # by the `gpus` annotation's per-GPU state and holders (issue 30). They are among
    # `gpus_free`; ranking prefers a node whose other free GPUs are enough for the pod.
    # A degraded GPU whose holders the agent cannot tell counts as free: at worst the
    # node ranks as if the pod might get that GPU.
    gpus_degraded_free: int = 0
    # Healthy free GPUs. An unhealthy GPU may be one a pod holds or a free one;
    # counting it as free would overcommit a dead device, so it is subtracted.
    gpus_free: int = field(init=False, compare=False)
    cpu_free_milli: int = field(init=False, compare=False)
    memory_free_bytes: int = field(init=False, compare=False)
    mig_free: dict[str, int] = field(init=False, compare=False)
    # The same without this extender's assumptions: what the filter judges.
    gpus_free_bound: int = field(init=False, compare=False)
    mig_free_bound: dict[str, int] = field(init=False, compare=False)

    def __post_init__(self) -> None:
        used = dict(self.mig_requested)
        object.__setattr__(
            self, "mig_free", {p: max(0, n - used.get(p, 0)) for p, n in self.mig_allocatable}
        )
        assumed = dict(self.mig_assumed)
        object.__setattr__(
            self,
            "mig_free_bound",
            {p: max(0, n - used.get(p, 0) + assumed.get(p, 0)) for p, n in self.mig_allocatable},
        )
        bound = self.gpus_allocatable - self.gpus_requested + self.gpus_assumed
        object.__setattr__(self, "gpus_free_bound", max(0, bound - self.gpus_unhealthy))
        free = self.gpus_allocatable - self.gpus_requested - self.gpus_unhealthy
        object.__setattr__(self, "gpus_free", max(0, free))
        cpu = self.cpu_allocatable_milli - self.cpu_requested_milli
        object.__setattr__(self, "cpu_free_milli", max(0, cpu))
        mem = self.memory_allocatable_bytes - self.memory_requested_bytes
        object.__setattr__(self, "memory_free_bytes", max(0, mem))

    def can_host(self, pod: PodShape) -> bool:
        """GPU count, CPU, memory and model all fit (the whole-GPU view)."""
        return (
            pod.gpus <= self.gpus_free
            and pod.cpu_milli <= self.cpu_free_milli
            and pod.memory_bytes <= self.memory_free_bytes
            and (pod.gpu_models is None or self.gpu_model in pod.gpu_models)
            and all(n <= self.mig_free.get(p, 0) for p, n in pod.mig)
        )

    def clean_fit(self, gpus: int) -> bool:
        """Enough free GPUs that are not degraded for `gpus` (see `gpus_degraded_free`)."""
        return self.gpus_free - self.gpus_degraded_free >= gpus

    @property
    def mig_free_total(self) -> int:
        return sum(self.mig_free.values())

    def with_placed(self, pod: PodShape) -> NodeState:
        """The node after the pod lands on it."""
        return replace(
            self,
            gpus_requested=self.gpus_requested + pod.gpus,
            cpu_requested_milli=self.cpu_requested_milli + pod.cpu_milli,
            memory_requested_bytes=self.memory_requested_bytes + pod.memory_bytes,
            mig_requested=add_mig(self.mig_requested, pod.mig),
            gpus_assumed=self.gpus_assumed + pod.gpus,
            mig_assumed=add_mig(self.mig_assumed, pod.mig),
        )
