"""Fragmentation-aware scoring (FGD, Weng et al., USENIX ATC'23), in the whole-GPU view.

A node's fragmentation is the weighted number of its free healthy GPUs that the
workload's typical pods could not use there:

    frag(node) = sum over typical shapes s of  w_s * unusable_s(node)
    unusable_s = free                          if s's GPU model constraint excludes the node
               = free - k_s * copies_s         otherwise, where
      copies_s = min(free // k_s, cpu_free // cpu_s, mem_free // mem_s)

i.e. the GPUs left over once as many copies of s as the node's GPUs, CPU and memory
allow are packed: too few GPUs, too little CPU or memory, or the wrong model all strand
GPUs. Shapes asking for no GPU cannot use GPUs and are left out.

    w_s = n_s * k_s / share_s

n_s * k_s is the shape's GPU demand (its count in the window times its GPUs: a rare
8-GPU shape is as much arriving work as eight times as many 1-GPU pods, and as costly
to strand). share_s is the fraction of the cluster's GPUs on nodes whose *allocatable*
resources and model could ever host s: a shape only a few nodes can take (an 8-GPU pod
wanting 120 cores, a pod pinned to one GPU model) gets those nodes protected in
proportion to how few they are. This is the one addition to FGD's popularity weight; it
uses static capacities only (no cluster-wide free-state bookkeeping).

    raw = -(frag(node after) - frag(node before)) + tie_break,   0 < tie_break < 1

Weights are integers, so every fragmentation difference is a whole number and the
tie-break (bin-packing: fewer free GPUs left; then more CPU used and busier GPUs) only
orders placements that fragment equally: it never overrides a strictly smaller increase.

Cost: fragmentation depends only on (model, free GPUs, free CPU, free memory), so it is
memoized on that key per table version; a request touches the shapes only for node
states not seen before. The tables change only when the typical set is refreshed (every
`refresh_every` GPU pods) or a node with new capacities appears, and such changes take
effect at the next `observe` (the start of a filter call), so one request scores
against one table.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from gpudaemon.cluster.policies.base import PolicySpec
from gpudaemon.cluster.state import NodeState, PodShape

NodeKey = tuple[str, int, int, int]  # (gpu model, free GPUs, free CPU milli, free bytes)
Capacity = tuple[str, int, int, int]  # (gpu model, allocatable GPUs, CPU milli, bytes)
_UNFIT = -1e18  # a node that cannot host the pod (the filter removes it anyway)
_MEMO_LIMIT = 100_000  # node states memoized (~25 MiB) before the memo starts over
_SCALE = 1000  # share_s in thousandths: weights stay integers
PRIOR_FRACTION = 0.9  # of a node class's CPU and memory, for its whole-node prior shape
PRIOR_SHAPES = 16  # whole-node prior shapes at most (the rarest hosts first)
PRIOR_CANDIDATES = 64  # whole-node shapes tried for the prior
PRIOR_MAX_GPUS = 64  # node classes claiming more GPUs get no prior shape


@dataclass(frozen=True, slots=True)
class TypicalPod:
    """One typical shape and its integer demand weight (pods x GPUs)."""

    shape: PodShape
    weight: int


class Workload:
    """The typical pods: learned from the GPU pods the extender sees, or fixed by config.

    Learned: the last `window` GPU pods' shapes are counted; every `refresh_every`
    observations (sooner while the window fills) the `max_shapes` shapes with the most
    GPU demand become the typical set and `version` moves on. Fixed: the set is given
    and never changes.
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
            if not fixed or any(t.weight < 1 or t.shape.gpus < 1 for t in fixed):
                raise ValueError("typical pods: at least one, each with weight >= 1, gpus >= 1")
            self._typical = tuple(sorted(fixed, key=lambda t: -t.weight))
            self.version = 1

    def observe(self, shape: PodShape) -> None:
        """Count one arriving pod. Pods asking for no GPU are ignored."""
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
            # Refresh early while the window fills, so a cold extender learns fast.
            if self._since_refresh >= min(self.refresh_every, max(1, len(self._recent) // 4)):
                self._refresh_locked()

    def _refresh_locked(self) -> None:
        self._since_refresh = 0
        top = sorted(self._counts.items(), key=lambda sn: -sn[1] * sn[0].gpus)
        typical = tuple(TypicalPod(s, n * s.gpus) for s, n in top[: self.max_shapes])
        if typical != self._typical:
            self._typical = typical
            self.version += 1

    def typical(self) -> tuple[int, tuple[TypicalPod, ...]]:
        """(version, typical set), read together."""
        with self._lock:
            return self.version, self._typical


def _fits(shape: PodShape, cap: Capacity) -> bool:
    model, gpus, cpu, mem = cap
    return (
        shape.gpus <= gpus
        and shape.cpu_milli <= cpu
        and shape.memory_bytes <= mem
        and shape.fits_model(model)
    )


def _prior_amount(x: int) -> int:
    """PRIOR_FRACTION of x, rounded down to a multiple of a power of two between 1/32
    and 1/16 of it: node classes that differ by a kubelet reservation get the same
    prior shape."""
    v = int(x * PRIOR_FRACTION)
    step = 1 << max(0, v.bit_length() - 5)
    return v - v % step


def _whole_node(cap: Capacity) -> PodShape:
    """A class's whole-node prior shape (any model)."""
    _, gpus, cpu, mem = cap
    return PodShape(gpus=gpus, cpu_milli=_prior_amount(cpu), memory_bytes=_prior_amount(mem))


def _biggest_first(s: PodShape) -> tuple[int, int, int]:
    return (-s.gpus, -s.cpu_milli, -s.memory_bytes)


def whole_node_shapes(capacity: Counter[Capacity]) -> tuple[TypicalPod, ...]:
    """The prior: one pod of each node class's whole size, as if seen once (demand k).

    A learned workload knows only the shapes it has seen, so a node class that alone
    can host some big shape (an 8-GPU pod wanting 120 cores) is unprotected until such
    a pod arrives, and the packing term alone prefers it for small pods when it has
    more CPU per GPU. Counting one whole-node pod per class keeps the rarest capacity
    whole until something needs it; its weight is one arrival's, so learned demand
    outweighs it as the window fills.

    Shapes that fit the same node classes count once, and at most PRIOR_SHAPES are
    kept, those with the fewest GPUs able to host them first. At most PRIOR_CANDIDATES
    shapes are tried (half the biggest, half the rarest classes' own), so thousands of
    distinct capacities cost what the learned shapes' weights do (shapes x classes),
    not classes squared.
    """
    # A node claiming more GPUs than any machine has is not a class to keep whole: its
    # weight would swamp every score (a compromised node sets its own allocatable).
    caps = [c for c in capacity if 1 <= c[1] <= PRIOR_MAX_GPUS]
    shapes = {_whole_node(c) for c in caps}
    if len(shapes) > PRIOR_CANDIDATES:
        # Half the biggest (they fit the fewest classes), half from the rarest classes.
        rarest = sorted(caps, key=lambda c: (c[1] * capacity[c], c))
        own = {_whole_node(c) for c in rarest[: PRIOR_CANDIDATES // 2]}
        biggest = sorted(shapes, key=_biggest_first)[: PRIOR_CANDIDATES - len(own)]
        shapes = own | set(biggest)
    # Keyed by the set of classes that can host it (as indices: cheap to hash).
    by_hosts: dict[frozenset[int], PodShape] = {}
    for shape in sorted(shapes, key=_biggest_first):
        g, cpu, mem = shape.gpus, shape.cpu_milli, shape.memory_bytes  # any model: _fits
        hosts = frozenset(
            i for i, c in enumerate(caps) if c[1] >= g and c[2] >= cpu and c[3] >= mem
        )
        by_hosts.setdefault(hosts, shape)
    ranked = sorted(
        by_hosts.items(),
        key=lambda hs: (sum(caps[i][1] * capacity[caps[i]] for i in hs[0]), -hs[1].gpus),
    )
    return tuple(TypicalPod(s, s.gpus) for _, s in ranked[:PRIOR_SHAPES])


class _Tables:
    """The weighted typical set, arranged for one fragmentation evaluation per state."""

    def __init__(
        self,
        typical: Sequence[TypicalPod],
        capacity: Counter[Capacity],
        prior: Sequence[TypicalPod] = (),
    ) -> None:
        seen = {t.shape for t in typical}
        typical = [*typical, *(t for t in prior if t.shape not in seen)]
        total = sum(cap[1] * n for cap, n in capacity.items())
        weighted: list[TypicalPod] = []
        for t in typical:
            if total:
                able = sum(cap[1] * n for cap, n in capacity.items() if _fits(t.shape, cap))
                if able == 0:
                    continue  # no node can ever host it: nothing to protect
                share = max(1, round(_SCALE * able / total))
            else:
                share = _SCALE  # no nodes known yet: plain demand weights
            weighted.append(TypicalPod(t.shape, max(1, round(t.weight * _SCALE / share))))
        self.typical = tuple(weighted)
        self._by_model: dict[str, tuple[int, tuple[tuple[int, int, int, int], ...]]] = {}
        self._suffix: dict[str, list[int]] = {}  # weight of fit[i:], per model

    def for_model(self, model: str) -> tuple[int, tuple[tuple[int, int, int, int], ...]]:
        """(weight of shapes that cannot run on `model`, (k, cpu, mem, w) of the rest,
        fewest GPUs first)."""
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
            fit.sort(key=lambda f: f[0])
            got = (never, tuple(fit))
            # The suffix first: a reader that finds the model's entry finds its suffix.
            self._suffix[model] = [sum(f[3] for f in fit[i:]) for i in range(len(fit))]
            self._by_model[model] = got
        return got

    def fragmentation(self, key: NodeKey) -> int:
        model, free, cpu, mem = key
        if free <= 0:
            return 0
        never, fit = self.for_model(model)
        total = never * free
        for i, (k, c, m, w) in enumerate(fit):
            if k > free:  # this and every later shape: all free GPUs stranded
                total += free * self._suffix[model][i]
                break
            copies = free // k
            if c and cpu < copies * c:
                copies = cpu // c
            if m and mem < copies * m:
                copies = mem // m
            total += w * (free - k * copies)
        return total


def node_key(node: NodeState) -> NodeKey:
    return (node.gpu_model, node.gpus_free, node.cpu_free_milli, node.memory_free_bytes)


def _capacity(node: NodeState) -> Capacity:
    return (
        node.gpu_model,
        node.gpus_allocatable,
        node.cpu_allocatable_milli,
        node.memory_allocatable_bytes,
    )


class Fragmentation:
    """FGD-style policy: the placement that fragments the node least scores highest."""

    name = "fragmentation"
    # A pod with no GPU still strands GPUs by taking the CPU and memory beside them:
    # score it too when the scheduler sends it (no managedResources filter).
    scores_gpuless_pods = True

    def __init__(self, workload: Workload | None = None, utilization_weight: float = 0.5) -> None:
        self.workload = workload if workload is not None else Workload()
        self.utilization_weight = min(1.0, max(0.0, utilization_weight))
        self._lock = threading.Lock()
        # (tables, memo, version), swapped as one reference: a reader without the lock
        # (a request scoring, `scores_version`) sees one consistent triple.
        self._state: tuple[_Tables, dict[NodeKey, int], tuple[int, int]] | None = None
        # Static capacities of the nodes seen, for each shape's share of the cluster.
        self._nodes: dict[str, Capacity] = {}
        self._last: dict[str, NodeState] = {}
        self._capacity: Counter[Capacity] = Counter()
        self._capacity_version = 0
        self._capacity_applied = 0
        self._applied: Counter[Capacity] = Counter()  # what the tables use
        self._prior: tuple[TypicalPod, ...] | None = None  # whole_node_shapes(_applied)
        self._seen_pods: OrderedDict[str, None] = OrderedDict()

    # -- learning ---------------------------------------------------------------------

    def observe_pod(self, uid: str, shape: PodShape) -> None:
        """A pod arrived (the start of a filter call). Counted once per UID: the scheduler
        retries an unschedulable pod, and a retry is not a new arrival. This is also the
        one point where a new typical set or new node capacities take effect, so the
        scoring calls that follow all use the same tables."""
        new = True
        with self._lock:
            if self._capacity_applied != self._capacity_version:
                self._capacity_applied = self._capacity_version
                self._applied = Counter(self._capacity)
                self._prior = None
            if uid:
                if uid in self._seen_pods:
                    new = False
                else:
                    self._seen_pods[uid] = None
                    if len(self._seen_pods) > 4 * self.workload.window:
                        self._seen_pods.popitem(last=False)
        if new:
            self.workload.observe(shape)
        self._refresh()

    def observe_node(self, node: NodeState) -> None:
        """A node appeared or changed (the informer's event): its static capacity counts
        toward each shape's share of the cluster from the next `observe_pod`."""
        # NodeState is immutable and replaced on change: the same object was noted.
        if self._last.get(node.name) is node:
            return
        cap = _capacity(node)
        with self._lock:
            self._last[node.name] = node
            old = self._nodes.get(node.name)
            if old == cap:
                return
            if old is not None:
                self._capacity[old] -= 1
                if self._capacity[old] <= 0:
                    del self._capacity[old]
            self._nodes[node.name] = cap
            self._capacity[cap] += 1
            self._capacity_version += 1

    def forget_node(self, name: str) -> None:
        with self._lock:
            self._last.pop(name, None)
            old = self._nodes.pop(name, None)
            if old is None:
                return
            self._capacity[old] -= 1
            if self._capacity[old] <= 0:
                del self._capacity[old]
            self._capacity_version += 1

    # -- scoring ----------------------------------------------------------------------

    def _refresh(self) -> tuple[_Tables, dict[NodeKey, int], tuple[int, int]]:
        wversion, typical = self.workload.typical()  # may be overtaken by another thread's
        with self._lock:
            version = (wversion, self._capacity_applied)
            state = self._state
            # Only forward: a typical set read before another thread's newer one is not
            # put back (the capacity count only grows, under this lock).
            if state is None or version > state[2]:
                tables = self._build_tables(wversion, typical, self._applied)
                state = self._state = (tables, {}, version)
            elif len(state[1]) > _MEMO_LIMIT:  # same tables, memo started over
                state = self._state = (state[0], {}, state[2])
            return state

    def _build_tables(
        self, wversion: int, typical: Sequence[TypicalPod], capacity: Counter[Capacity]
    ) -> _Tables:
        """The tables for one typical set and capacity count (a variant's hook)."""
        return _Tables(typical, capacity, self._applied_prior())

    def _applied_prior(self) -> tuple[TypicalPod, ...]:
        """`whole_node_shapes` of the applied capacities (the `capacity` the tables are
        built from), kept until they change: with every node its own class it costs
        classes x shapes, too much per refresh. Called under the lock, by `_refresh`.
        A workload fixed by configuration is what the operator says it is: no prior."""
        if self._prior is None:
            self._prior = () if self.workload.fixed else whole_node_shapes(self._applied)
        return self._prior

    def scores_version(self) -> object:
        """The tables' version: they change only at `observe`, so scores taken between
        two observations agree. Read from the same reference as the tables."""
        return (self._state or self._refresh())[2]

    def fragmentation(self, node: NodeState) -> int:
        """The node's fragmentation under the current tables."""
        tables, memo, _ = self._state or self._refresh()
        return _frag(tables, memo, node_key(node))

    def raw_score(self, node: NodeState, pod: PodShape) -> float:
        """Pure: reads the tables as of the last `observe_pod` (the memo of fragmentation
        per node class is a cache of a pure function, not learned state)."""
        free, cpu, mem = node.gpus_free, node.cpu_free_milli, node.memory_free_bytes
        k, c, m = pod.gpus, pod.cpu_milli, pod.memory_bytes
        model = node.gpu_model
        if k > free or c > cpu or m > mem or not pod.fits_model(model):
            return _UNFIT
        tables, memo, _ = self._state or self._refresh()
        before = (model, free, cpu, mem)
        after = (model, free - k, cpu - c, mem - m)
        fb = memo.get(before)
        if fb is None:
            fb = memo[before] = tables.fragmentation(before)
        fa = memo.get(after)
        if fa is None:
            fa = memo[after] = tables.fragmentation(after)
        return float(fb - fa) + tie_break(node, pod, self.utilization_weight)

    def score_parts(self, node: NodeState, pod: PodShape) -> tuple[NodeKey, float]:
        """`raw_score` in two parts, for a node that can host the pod: (the node's key
        for `key_score`, its tie-break). The tie-break does not move when the tables
        do, so a caller that keeps it rescores a node with one lookup per key:
        raw_score(node, pod) == key_score(key, pod) + tie, to the bit."""
        return node_key(node), tie_break(node, pod, self.utilization_weight)

    def key_score(self, key: NodeKey, pod: PodShape) -> float | None:
        """The fragmentation the pod removes from a node of this key, under the current
        tables (None: it does not fit there; raw_score says _UNFIT)."""
        model, free, cpu, mem = key
        k, c, m = pod.gpus, pod.cpu_milli, pod.memory_bytes
        if k > free or c > cpu or m > mem or not pod.fits_model(model):
            return None
        tables, memo, _ = self._state or self._refresh()
        return float(
            _frag(tables, memo, key) - _frag(tables, memo, (model, free - k, cpu - c, mem - m))
        )

    def raw_scores(self, nodes: Iterable[NodeState], pod: PodShape) -> list[float]:
        return [self.raw_score(n, pod) for n in nodes]


def _frag(tables: _Tables, memo: dict[NodeKey, int], key: NodeKey) -> int:
    v = memo.get(key)
    if v is None:
        # Two threads may compute the same value at once; both are right.
        v = memo[key] = tables.fragmentation(key)
    return v


def tie_break(node: NodeState, pod: PodShape, utilization_weight: float = 0.5) -> float:
    """In (0, 0.9]: fewer free GPUs left first (bin-packing); among nodes left with equal
    free GPUs, more of the CPU used, then busier GPUs.

    The GPU term drops by 0.6/((1+f)(2+f)) from f to f+1 free GPUs left; the second
    term stays below that step, so it never reorders different free-GPU counts.
    """
    free_after = max(0, node.gpus_free - pod.gpus)
    step = 0.6 / ((1 + free_after) * (2 + free_after))
    cpu_used = 0.0
    if node.cpu_allocatable_milli > 0:
        used = node.cpu_requested_milli + pod.cpu_milli
        cpu_used = min(1.0, max(0.0, used / node.cpu_allocatable_milli))
    u = node.utilization_ratio
    util = 0.0 if u is None else (1.0 if u > 1.0 else (u if u > 0.0 else 0.0))
    second = (cpu_used + utilization_weight * util) / (1 + utilization_weight)
    return 0.6 / (1 + free_after) + 0.999 * step * second


def make_fragmentation(ext: Any, utilization_weight: float = 0.5) -> Fragmentation:
    """The policy from `ExtenderConfig`: learned over `workload_window` GPU pods, or the
    fixed `typical_pods` (weight = relative frequency of that shape among GPU pods)."""
    entries = list(getattr(ext, "typical_pods", []) or [])
    window = int(getattr(ext, "workload_window", 2000))
    if not entries:
        return Fragmentation(Workload(window=window), utilization_weight)
    fixed = []
    for e in entries:
        shape = PodShape(
            gpus=int(e.gpus),
            cpu_milli=int(e.cpu_milli),
            memory_bytes=int(e.memory_mib) << 20,
            gpu_models=frozenset(e.gpu_models) if e.gpu_models else None,
        )
        fixed.append(TypicalPod(shape, max(1, round(float(e.weight) * _SCALE)) * shape.gpus))
    return Fragmentation(Workload(window=window, fixed=fixed), utilization_weight)


SPEC = PolicySpec(
    "fragmentation",
    lambda ext: make_fragmentation(ext, utilization_weight=ext.utilization_weight),
    "fewest GPUs stranded for the workload's typical pods (FGD); learns the workload",
    ("utilization_weight", "workload_window", "typical_pods"),
)
