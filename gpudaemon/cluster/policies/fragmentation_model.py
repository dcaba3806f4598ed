"""Model-aware fragmentation: FGD's measure per GPU model, with the model's scarcity
for the pods that can run only on it.

FGD (fragmentation.py) measures a node against one typical workload, and counts every
free GPU of a model that a typical shape does not accept as stranded for that shape.
When pods name the GPU models they accept (required node affinity or nodeSelector on
the product label), that has two faults. A flexible pod is steered by which shapes
*cannot* use a model, not by which pods *need* it, so it can land on the one model a
group of pinned pods has no alternative to, and those pods are turned away later while
the GPUs the flexible pod could have used stay idle. And the learned typical set (the
shapes with the most GPU demand) can leave out a pinned group's shapes altogether.

Here the workload and the measure are per model:

- **Typical pods per model set.** The shapes seen are grouped by the set of models
  they accept (None: any). Every group gets typical shapes in proportion to its GPU
  demand, at least one, so a pinned group is never dropped from the set. The typical
  workload of model M is the typical shapes that accept M.
- **Scarcity of a model for its pinned demand.** For each pinned group A, f_A is its
  share of the GPU demand seen and share_A the share of the cluster's GPUs of a model
  in A. Spread over its models in proportion to their GPUs, A asks for f_A / share_A
  of each model's capacity over a fill of the cluster, so

      pinned_M = min(1, sum over pinned groups A containing M of  f_A / share_A)

  is the share of M's GPUs the pods confined to M's groups will claim: a flexible pod
  that takes one of M's GPUs turns away pinned work of pinned_M GPUs, and the GPU it
  could have used elsewhere stays idle.
- **Fragmentation of a node of model M.**

      frag(node) = sum over typical shapes s accepting M of  w_s * unusable_s(node)
                 + round(U * (1 - pinned_M)) * free(node)

  The first term is FGD's packing measure against M's own typical workload (w_s and
  unusable_s as in fragmentation.py; shapes that cannot run on M no longer count M's
  GPUs as stranded). The second counts the share of M's free GPUs that no pinned pod
  will claim as stranded for the flexible pods, at U = the whole typical set's weight
  (a GPU no typical pod can use; the set includes fragmentation.py's whole-node prior,
  so U is larger while few pods have been seen). Placing k GPUs on M lowers it by
  U * (1 - pinned_M) * k, so between two models the scarcer one costs
  U * (pinned_M - pinned_M') * k more: the expected pinned GPUs blocked, in the same
  units as the packing term.

    raw = -(frag(node after) - frag(node before)) + tie_break, as in fragmentation.py.

With no pinned pods seen, every model has pinned_M = 0 and the second term adds the
same U * k to every node the pod fits: the order of nodes is plain fragmentation's.
The scarcity uses static capacities and the learned demand mix (no cluster-wide free
state), is recomputed with the typical set, and is memoized with it per node key, so a
request costs what fragmentation's does.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

from gpudaemon.cluster.policies.base import PolicySpec
from gpudaemon.cluster.policies.fragmentation import (
    _SCALE,
    Capacity,
    Fragmentation,
    NodeKey,
    TypicalPod,
    Workload,
    _Tables,
)
from gpudaemon.cluster.state import PodShape

ModelSet = frozenset[str] | None  # the GPU models a pod accepts (None: any)


class ModelWorkload(Workload):
    """The learned workload, its typical set chosen per model set, and the GPU demand
    of each model set in the window (exact: not limited to the typical shapes)."""

    def __init__(self, **kwargs: Any) -> None:
        self._groups: dict[ModelSet, int] = {}
        super().__init__(**kwargs)
        if self.fixed:
            self._groups = dict(_group_demand((t.shape, t.weight) for t in self._typical))

    def _refresh_locked(self) -> None:
        self._since_refresh = 0
        shapes = [(s, n * s.gpus) for s, n in self._counts.items()]
        groups = dict(_group_demand(shapes))
        typical = _typical_per_group(shapes, groups, self.max_shapes)
        if typical != self._typical or groups != self._groups:
            self._typical, self._groups = typical, groups
            self.version += 1

    def groups(self) -> tuple[int, dict[ModelSet, int]]:
        """(version, GPU demand by model set), read together."""
        with self._lock:
            return self.version, self._groups


def _group_demand(shapes: Any) -> Counter[ModelSet]:
    out: Counter[ModelSet] = Counter()
    for s, demand in shapes:
        out[s.gpu_models] += demand
    return out


def _typical_per_group(
    shapes: list[tuple[PodShape, int]], groups: dict[ModelSet, int], max_shapes: int
) -> tuple[TypicalPod, ...]:
    """The shapes with most demand in each model set, each set's count in proportion to
    its demand (at least one); places left over go to the most demanded of the rest."""
    total = sum(groups.values())
    if not total:
        return ()
    # Stable on the window's order, as Workload ranks: one model set picks its shapes.
    ranked = sorted(shapes, key=lambda sd: -sd[1])
    quota = {g: max(1, math.floor(max_shapes * d / total)) for g, d in groups.items()}
    taken: list[tuple[PodShape, int]] = []
    rest: list[tuple[PodShape, int]] = []
    for s, d in ranked:
        if quota[s.gpu_models] > 0:
            quota[s.gpu_models] -= 1
            taken.append((s, d))
        else:
            rest.append((s, d))
    taken += rest[: max(0, max_shapes - len(taken))]
    taken.sort(key=lambda sd: -sd[1])
    return tuple(TypicalPod(s, d) for s, d in taken)


def pinned_shares(groups: dict[ModelSet, int], capacity: Counter[Capacity]) -> dict[str, float]:
    """pinned_M for every model with GPUs: the share of its GPUs that the pods
    confined to model sets containing it will claim over a fill (capped at 1)."""
    gpus: Counter[str] = Counter()
    for (model, n, _, _), nodes in capacity.items():
        gpus[model] += n * nodes
    total_gpus = sum(gpus.values())
    demand = sum(groups.values())
    out = dict.fromkeys(gpus, 0.0)
    if not total_gpus or not demand:
        return out
    for models, d in groups.items():
        if models is None:
            continue
        able = sum(gpus[m] for m in models)
        if not able:
            continue  # no node has its models: it never competes for any
        claim = (d / demand) / (able / total_gpus)
        for m in models:
            if m in out:
                out[m] += claim
    return {m: min(1.0, p) for m, p in out.items()}


class _ModelTables(_Tables):
    """fragmentation.py's tables with the per-model measure (module docstring)."""

    def __init__(
        self,
        typical: Sequence[TypicalPod],
        capacity: Counter[Capacity],
        groups: dict[ModelSet, int],
        prior: Sequence[TypicalPod] = (),
    ) -> None:
        super().__init__(typical, capacity, prior)
        self.pinned = pinned_shares(groups, capacity)
        self.unit = sum(t.weight for t in self.typical)  # U: a GPU no typical pod can use
        self._free_weight: dict[str, int] = {}

    def free_weight(self, model: str) -> int:
        w = self._free_weight.get(model)
        if w is None:
            w = self._free_weight[model] = round(self.unit * (1.0 - self.pinned.get(model, 0.0)))
        return w

    def fragmentation(self, key: NodeKey) -> int:
        model, free = key[0], key[1]
        if free <= 0:
            return 0
        never, _ = self.for_model(model)
        # FGD's measure less its term for the shapes that cannot run on this model.
        packing = super().fragmentation(key) - never * free
        return packing + self.free_weight(model) * free


class ModelFragmentation(Fragmentation):
    """Fragmentation per GPU model, weighted by each model's scarcity for pinned pods."""

    name = "fragmentation-model"
    workload: ModelWorkload

    def __init__(
        self, workload: ModelWorkload | None = None, utilization_weight: float = 0.5
    ) -> None:
        super().__init__(workload if workload is not None else ModelWorkload(), utilization_weight)

    def _build_tables(
        self, wversion: int, typical: Sequence[TypicalPod], capacity: Counter[Capacity]
    ) -> _Tables:
        gversion, groups = self.workload.groups()
        if gversion != wversion:  # moved on since `typical` was read: the pair is rebuilt
            wversion, typical = self.workload.typical()
            gversion, groups = self.workload.groups()
        return _ModelTables(typical, capacity, groups, self._applied_prior())

    def pinned_share(self, model: str) -> float:
        """pinned_M under the current tables (for tests and inspection)."""
        tables = (self._state or self._refresh())[0]
        assert isinstance(tables, _ModelTables)
        return tables.pinned.get(model, 0.0)


def make_model_fragmentation(ext: Any, utilization_weight: float = 0.5) -> ModelFragmentation:
    """From `ExtenderConfig`, as `make_fragmentation`: learned over `workload_window`
    GPU pods, or the fixed `typical_pods` (their `gpu_models` make the pinned groups)."""
    entries = list(getattr(ext, "typical_pods", []) or [])
    window = int(getattr(ext, "workload_window", 2000))
    if not entries:
        return ModelFragmentation(ModelWorkload(window=window), utilization_weight)
    fixed = []
    for e in entries:
        shape = PodShape(
            gpus=int(e.gpus),
            cpu_milli=int(e.cpu_milli),
            memory_bytes=int(e.memory_mib) << 20,
            gpu_models=frozenset(e.gpu_models) if e.gpu_models else None,
        )
        fixed.append(TypicalPod(shape, max(1, round(float(e.weight) * _SCALE)) * shape.gpus))
    return ModelFragmentation(ModelWorkload(window=window, fixed=fixed), utilization_weight)


SPEC = PolicySpec(
    "fragmentation-model",
    lambda ext: make_model_fragmentation(ext, utilization_weight=ext.utilization_weight),
    "fragmentation per GPU model: FGD against the typical pods that accept the "
    "node's model (chosen per model set), and a flexible pod charged for the GPUs "
    "it takes from pods pinned to that model (their demand over its GPUs, at most "
    "all of them); learns the workload",
    ("utilization_weight", "workload_window", "typical_pods"),
)
