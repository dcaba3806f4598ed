"""Fragmentation-aware scoring (FGD, Weng et al., USENIX ATC'23), in the whole-GPU view.

A node's fragmentation for a workload is the frequency-weighted number of its free
healthy GPUs that the workload's typical pods could not use there:

    frag(node) = sum over typical shapes s of  w_s * unusable_s(node)
    unusable_s = free                                  if s's GPU model does not fit
               = free - k_s * copies_s                 otherwise, where
      copies_s = min(free // k_s, cpu_free // cpu_s, mem_free // mem_s)

that is, the GPUs left over once as many copies of s as the node's GPUs, CPU and memory
allow have been packed (too few GPUs, too little CPU or memory, or the wrong model all
strand GPUs). Shapes asking for no GPU cannot use GPUs at all and are left out.

    raw = -(frag(node after) - frag(node before)) + tie_break,   0 <= tie_break < 1

Weights are integers (window counts), so every fragmentation difference is an integer
and the tie-break (bin-packing: fewer free GPUs left, then less CPU left) can only order
placements that fragment equally; it never overrides a strictly smaller increase.

Cost: fragmentation depends only on (model, free GPUs, free CPU, free memory), so it is
memoized on that key per workload version; scoring 5,000 nodes touches the shapes only
for states not seen before, and the workload's version changes only when its typical set
is refreshed (every `refresh_every` observations), not on every pod.
"""

from __future__ import annotations

import math
import threading
from collections import Counter, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpudaemon.extender.state import NodeState, PodShape

NodeKey = tuple[str, int, int, int]  # (gpu model, free GPUs, free CPU milli, free bytes)
_UNFIT = -1e18  # a node that cannot host the pod (the filter removes it anyway)
_MEMO_LIMIT = 200_000  # distinct node states memoized before the memo starts over


@dataclass(frozen=True, slots=True)
class TypicalPod:
    """One typical shape and its integer weight (how often it arrives)."""

    shape: PodShape
    weight: int


class Workload:
    """The typical pods: learned from the pods the extender sees, or fixed by config.

    Learned: the last `window` GPU pods' shapes are counted; every `refresh_every`
    observations the `max_shapes` most frequent become the typical set and `version`
    moves on (which invalidates scores memoized against the old set). Fixed: the set is
    given and `observe` only counts.
    """

    def __init__(
        self,
        *,
        window: int = 2000,
        max_shapes: int = 32,
        refresh_every: int = 50,
        fixed: Sequence[TypicalPod] | None = None,
    ) -> None:
        if window < 1 or max_shapes < 1 or refresh_every < 1:
            raise ValueError("window, max_shapes and refresh_every must be >= 1")
        self.window = window
        self.max_shapes = max_shapes
        self.refresh_every = refresh_every
        self._lock = threading.Lock()
        self._recent: deque[PodShape] = deque()
        self._counts: Counter[PodShape] = Counter()
        self._since_refresh = 0
        self.observed = 0
        self.fixed = fixed is not None
        self.version = 0
        self._typical: tuple[TypicalPod, ...] = ()
        if fixed is not None:
            bad = [t for t in fixed if t.weight < 1 or t.shape.gpus < 1]
            if bad:
                raise ValueError("typical pods need weight >= 1 and gpus >= 1")
            self._typical = tuple(sorted(fixed, key=lambda t: -t.weight))
            self.version = 1

    @classmethod
    def from_config(cls, items: Iterable[Mapping[str, Any]]) -> Workload:
        """A fixed workload from config entries: {gpus, cpu, memory, gpu_models, weight}.
        cpu and memory are Kubernetes quantities; bad entries raise ValueError (one line)."""
        from gpudaemon.extender.podspec import quantity

        out: list[TypicalPod] = []
        for i, item in enumerate(items):
            try:
                gpus = item["gpus"]
                weight = item.get("weight", 1)
                if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1:
                    raise ValueError(f"gpus must be an integer >= 1, got {gpus!r}")
                if not isinstance(weight, int) or isinstance(weight, bool) or weight < 1:
                    raise ValueError(f"weight must be an integer >= 1, got {weight!r}")
                models = item.get("gpu_models")
                if models is not None and (
                    not isinstance(models, list) or not all(isinstance(m, str) for m in models)
                ):
                    raise ValueError("gpu_models must be a list of product label values")
                unknown = set(item) - {"gpus", "cpu", "memory", "gpu_models", "weight"}
                if unknown:
                    raise ValueError(f"unknown key(s) {', '.join(sorted(unknown))}")
                shape = PodShape(
                    gpus=gpus,
                    cpu_milli=math.ceil(round(quantity(item.get("cpu", 0)) * 1000, 6)),
                    memory_bytes=math.ceil(quantity(item.get("memory", 0))),
                    gpu_models=None if models is None else frozenset(models),
                )
            except KeyError as e:
                raise ValueError(f"typical_pods[{i}]: missing {e.args[0]!r}") from None
            except (ValueError, TypeError, AttributeError) as e:
                raise ValueError(f"typical_pods[{i}]: {e}") from None
            out.append(TypicalPod(shape, weight))
        if not out:
            raise ValueError("typical_pods: give at least one entry")
        return cls(fixed=out)

    def observe(self, shape: PodShape) -> None:
        """Count one arriving pod (from filter or prioritize; once per pod is the caller's
        job). Pods asking for no GPU are ignored: they cannot use GPUs anyway."""
        if shape.gpus < 1:
            return
        with self._lock:
            self.observed += 1
            if self.fixed:
                return
            self._recent.append(shape)
            self._counts[shape] += 1
            if len(self._recent) > self.window:
                old = self._recent.popleft()
                self._counts[old] -= 1
                if self._counts[old] <= 0:
                    del self._counts[old]
            self._since_refresh += 1
            # Refresh early while the window is filling, so a cold extender learns fast.
            if self._since_refresh >= min(self.refresh_every, max(1, len(self._recent) // 4)):
                self._refresh_locked()

    def _refresh_locked(self) -> None:
        self._since_refresh = 0
        top = self._counts.most_common(self.max_shapes)
        typical = tuple(TypicalPod(s, n) for s, n in top)
        if typical != self._typical:
            self._typical = typical
            self.version += 1

    def typical(self) -> tuple[int, tuple[TypicalPod, ...]]:
        """(version, typical set), read together."""
        with self._lock:
            return self.version, self._typical


class _Tables:
    """The typical set, arranged for one fragmentation evaluation per node state."""

    def __init__(self, typical: Sequence[TypicalPod]) -> None:
        self.typical = tuple(typical)
        self._by_model: dict[str, tuple[int, tuple[tuple[int, int, int, int], ...]]] = {}

    def for_model(self, model: str) -> tuple[int, tuple[tuple[int, int, int, int], ...]]:
        """(weight of shapes that cannot run on `model`, (k, cpu, mem, w) of those that can)."""
        got = self._by_model.get(model)
        if got is None:
            never = 0
            fit: list[tuple[int, int, int, int]] = []
            for t in self.typical:
                s = t.shape
                if s.fits_model(model):
                    fit.append((s.gpus, s.cpu_milli, s.memory_bytes, t.weight))
                else:
                    never += t.weight
            got = (never, tuple(fit))
            self._by_model[model] = got
        return got

    def fragmentation(self, key: NodeKey) -> int:
        model, free, cpu, mem = key
        if free <= 0:
            return 0
        never, fit = self.for_model(model)
        total = never * free
        for k, c, m, w in fit:
            copies = free // k
            if c > 0:
                copies = min(copies, cpu // c)
            if m > 0:
                copies = min(copies, mem // m)
            total += w * (free - k * copies)
        return total


def node_key(node: NodeState) -> NodeKey:
    return (node.gpu_model, node.gpus_free, node.cpu_free_milli, node.memory_free_bytes)


class Fragmentation:
    """FGD-style policy: the placement that fragments the node least scores highest."""

    name = "fragmentation"

    def __init__(self, workload: Workload | None = None) -> None:
        self.workload = workload if workload is not None else Workload()
        self._lock = threading.Lock()
        self._version = -1
        self._tables = _Tables(())
        self._memo: dict[NodeKey, int] = {}

    def _current(self) -> tuple[_Tables, dict[NodeKey, int]]:
        version, typical = self.workload.typical()
        with self._lock:
            if version != self._version or len(self._memo) > _MEMO_LIMIT:
                self._version = version
                self._tables = _Tables(typical)
                self._memo = {}
            return self._tables, self._memo

    def fragmentation(self, node: NodeState) -> int:
        """The node's fragmentation under the current typical set (integer weights)."""
        tables, memo = self._current()
        return self._frag(tables, memo, node_key(node))

    @staticmethod
    def _frag(tables: _Tables, memo: dict[NodeKey, int], key: NodeKey) -> int:
        v = memo.get(key)
        if v is None:
            # A race between two threads computes the same value twice; both are right.
            v = memo[key] = tables.fragmentation(key)
        return v

    def raw_score(self, node: NodeState, pod: PodShape) -> float:
        if not node.can_host(pod):
            return _UNFIT
        tables, memo = self._current()
        before = node_key(node)
        after = (
            before[0],
            before[1] - pod.gpus,
            before[2] - pod.cpu_milli,
            before[3] - pod.memory_bytes,
        )
        increase = self._frag(tables, memo, after) - self._frag(tables, memo, before)
        return -float(increase) + tie_break(node, pod)

    def raw_scores(self, nodes: Iterable[NodeState], pod: PodShape) -> list[float]:
        """Several nodes for one pod, reading the workload once."""
        return [self.raw_score(n, pod) for n in nodes]


def tie_break(node: NodeState, pod: PodShape) -> float:
    """In [0, 0.99): fewer free GPUs left first (bin-packing), then less CPU left."""
    free_after = max(0, node.gpus_free - pod.gpus)
    gpus = 0.9 / (1 + free_after)  # (0, 0.9]; 1 free GPU more always costs > 0.09
    cpu_alloc = node.cpu_allocatable_milli
    cpu_used = 0.0
    if cpu_alloc > 0:
        cpu_used = min(1.0, (node.cpu_requested_milli + pod.cpu_milli) / cpu_alloc)
    return gpus + 0.09 * cpu_used * (gpus / 0.9) * 0.999  # scaled below the next GPU step
