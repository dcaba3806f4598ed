"""The offline optimum of a whole-GPU packing: the most GPUs that any placement of a set
of pods can allocate on a set of nodes, each pod whole on one node or not at all, per
node the sums of gpus, cpu and memory within allocatable, and a pod pinned to GPU models
only on a node of one of them. bench/optimum's solver, here so that its tests can check
it against brute force (tests never import bench/).

Nodes and pods are aggregated into types. The configuration LP has one column per node
type and configuration (a multiset of pod types that fits one node of it), at most as
many nodes per type as there are and at most as many pods per type as arrived; it is
solved by column generation: HiGHS (scipy.optimize.linprog) for the restricted master,
a knapsack MILP per node type (scipy.optimize.milp) for pricing. Every round's duals
give a Lagrangian bound that is valid before convergence, computed from the pricing
MILPs' dual bounds; GPUs are whole, so its floor bounds the allocated GPUs. The integer
solution (a real placement) is the master restricted to the generated columns as a MILP,
then a best-fit pass over what it left, then an exact per-node MILP over neighbourhoods
(the nodes with free GPUs and others drawn at random) until it reaches the bound or the
time limit; `check` verifies it node by node.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, linprog, milp

EPS = 1e-6  # above HiGHS's default tolerances (1e-7); values are whole GPUs


class NodeLike(Protocol):
    @property
    def model(self) -> str: ...
    @property
    def gpus(self) -> int: ...
    @property
    def cpu_milli(self) -> int: ...
    @property
    def memory_mib(self) -> int: ...


class PodLike(Protocol):
    @property
    def gpus(self) -> int: ...
    @property
    def cpu_milli(self) -> int: ...
    @property
    def memory_mib(self) -> int: ...
    @property
    def gpu_spec(self) -> tuple[str, ...]: ...


@dataclass(frozen=True)
class NodeType:
    model: str
    gpus: int
    cpu_milli: int
    memory_mib: int
    count: int


@dataclass(frozen=True)
class PodType:
    gpus: int
    cpu_milli: int
    memory_mib: int
    models: frozenset[str]  # empty: any model
    count: int

    def may_run_on(self, node: NodeType) -> bool:
        return not self.models or node.model in self.models

    def fits(self, node: NodeType) -> int:
        """How many of this pod fit one empty node of that type (model included)."""
        if not self.may_run_on(node):
            return 0
        n = self.count
        for need, have in (
            (self.gpus, node.gpus),
            (self.cpu_milli, node.cpu_milli),
            (self.memory_mib, node.memory_mib),
        ):
            if need > have:
                return 0
            if need > 0:
                n = min(n, have // need)
        return n


def node_types(nodes: Iterable[NodeLike]) -> list[NodeType]:
    c = Counter((n.model, n.gpus, n.cpu_milli, n.memory_mib) for n in nodes)
    return [NodeType(*k, count=v) for k, v in sorted(c.items())]


def pod_types(pods: Iterable[PodLike]) -> list[PodType]:
    c = Counter((p.gpus, p.cpu_milli, p.memory_mib, frozenset(p.gpu_spec)) for p in pods)
    types = [PodType(*k, count=v) for k, v in c.items()]
    return sorted(types, key=lambda t: (-t.gpus, -t.cpu_milli, -t.memory_mib, sorted(t.models)))


# A placement: (node type index, pods per pod type on each such node, how many nodes).
Placement = list[tuple[int, tuple[int, ...], int]]


class InvalidPlacement(ValueError):
    """A placement that breaks a rule (raised, not asserted: `python -O` keeps it)."""


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise InvalidPlacement(what)


def check(nts: Sequence[NodeType], pts: Sequence[PodType], placement: Placement) -> int:
    """The GPUs a placement allocates; InvalidPlacement if it breaks a rule."""
    nodes_used = [0] * len(nts)
    pods_used = [0] * len(pts)
    gpus = 0
    for t, counts, k in placement:
        nt = nts[t]
        _require(k >= 0 and len(counts) == len(pts), f"malformed entry {(t, counts, k)}")
        nodes_used[t] += k
        use = [0, 0, 0]
        for p, a in enumerate(counts):
            _require(a >= 0, f"a negative count of pod type {p}")
            if a == 0:
                continue
            pt = pts[p]
            _require(pt.may_run_on(nt), f"pod type {p} on a {nt.model} node")
            use[0] += a * pt.gpus
            use[1] += a * pt.cpu_milli
            use[2] += a * pt.memory_mib
            pods_used[p] += a * k
        _require(
            use[0] <= nt.gpus and use[1] <= nt.cpu_milli and use[2] <= nt.memory_mib,
            f"node type {t} over allocatable: {use}",
        )
        gpus += k * use[0]
    for t, (u, nt) in enumerate(zip(nodes_used, nts, strict=True)):
        _require(u <= nt.count, f"{u} nodes of type {t}, which has {nt.count}")
    for p, (u, pt) in enumerate(zip(pods_used, pts, strict=True)):
        _require(u <= pt.count, f"{u} pods of type {p}, of {pt.count} arrived")
    return gpus


@dataclass
class Solution:
    total_gpus: int
    lp_gpus: float  # the restricted master's value at the last round
    bound_gpus: int  # no placement allocates more (the LP's, or the exact MILP's)
    placed_gpus: int  # what `placement` allocates
    placement: Placement
    rounds: int
    columns: int
    converged: bool  # no column left with a positive reduced cost
    exact: bool  # a per-node MILP over every node proved `placement` optimal
    seconds: float

    @property
    def unallocated_bound_pct(self) -> float:
        """No scheduler leaves fewer GPUs unallocated (the optimum is at least this)."""
        return 100.0 * (self.total_gpus - self.bound_gpus) / self.total_gpus

    @property
    def unallocated_placed_pct(self) -> float:
        """A real placement leaves this many (the optimum is at most this)."""
        return 100.0 * (self.total_gpus - self.placed_gpus) / self.total_gpus

    @property
    def proven(self) -> bool:
        """The placement is an optimum: it reaches the bound."""
        return self.placed_gpus == self.bound_gpus


def _resources(pts: Sequence[PodType]) -> np.ndarray[Any, np.dtype[np.float64]]:
    return np.array(
        [[p.gpus for p in pts], [p.cpu_milli for p in pts], [p.memory_mib for p in pts]],
        dtype=float,
    )


def _price(
    nt: NodeType, pts: Sequence[PodType], values: Sequence[float], time_limit_s: float
) -> tuple[float, float, tuple[int, ...]]:
    """Best configuration of one node of type `nt` for these pod values: (its value,
    an upper bound on any configuration's value, its counts)."""
    idx = [p for p, pt in enumerate(pts) if values[p] > EPS and pt.fits(nt) > 0]
    if not idx:
        return 0.0, 0.0, (0,) * len(pts)
    sub = [pts[p] for p in idx]
    res = milp(
        c=-np.array([values[p] for p in idx]),
        integrality=np.ones(len(idx)),
        bounds=Bounds(0, np.array([pt.fits(nt) for pt in sub], dtype=float)),
        constraints=LinearConstraint(
            _resources(sub), -np.inf, np.array([nt.gpus, nt.cpu_milli, nt.memory_mib], float)
        ),
        options={"time_limit": time_limit_s, "mip_rel_gap": 0.0},
    )
    counts = [0] * len(pts)
    value = 0.0
    if res.x is not None:
        for p, a in zip(idx, np.round(res.x).astype(int), strict=True):
            counts[p] = int(a)
        if _fits(nt, pts, counts):
            value = sum(values[p] * counts[p] for p in idx)
        else:
            counts = [0] * len(pts)
    dual = getattr(res, "mip_dual_bound", None)
    upper = -float(dual) if dual is not None and math.isfinite(dual) else math.inf
    if res.status == 0 and not math.isfinite(upper):
        upper = -float(res.fun)
    # Every pod it could hold at full value: a bound whatever the MILP reported.
    upper = min(upper, sum(values[p] * pts[p].fits(nt) for p in idx))
    return value, max(upper, value), tuple(counts)


def _fits(nt: NodeType, pts: Sequence[PodType], counts: Sequence[int]) -> bool:
    if any(a and not pts[p].may_run_on(nt) for p, a in enumerate(counts)):
        return False
    use = _resources(pts) @ np.array(counts, dtype=float)
    return bool(use[0] <= nt.gpus and use[1] <= nt.cpu_milli and use[2] <= nt.memory_mib)


def all_columns(
    nts: Sequence[NodeType], pts: Sequence[PodType]
) -> list[tuple[int, tuple[int, ...]]]:
    """Every maximal-or-not configuration of every node type: for tiny instances only."""
    out = []
    for t, nt in enumerate(nts):
        ranges = [range(pt.fits(nt) + 1) for pt in pts]
        for counts in itertools.product(*ranges):
            if any(counts) and _fits(nt, pts, counts):
                out.append((t, tuple(counts)))
    return out


def _master(
    nts: Sequence[NodeType],
    pts: Sequence[PodType],
    cols: Sequence[tuple[int, tuple[int, ...]]],
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    gpus = np.array([sum(a * pts[p].gpus for p, a in enumerate(c)) for _, c in cols], float)
    a = np.zeros((len(nts) + len(pts), len(cols)))
    for j, (t, c) in enumerate(cols):
        a[t, j] = 1.0
        a[len(nts) :, j] = c
    b = np.array([nt.count for nt in nts] + [pt.count for pt in pts], float)
    return gpus, a, b


def solve(
    nts: Sequence[NodeType],
    pts: Sequence[PodType],
    *,
    columns: Sequence[tuple[int, tuple[int, ...]]] | None = None,
    max_rounds: int = 500,
    time_limit_s: float = 300.0,
    milp_time_limit_s: float = 60.0,
    progress: Callable[[str], None] | None = None,
    seed: int = 0,
) -> Solution:
    """The bound and an integer placement. With `columns`, which must then be every
    configuration (all_columns), nothing is generated and the LP over them is the bound."""
    t0 = time.monotonic()
    total = sum(nt.gpus * nt.count for nt in nts)
    # Pods asking for no GPU add nothing and a pod may stay out: only GPU pods matter.
    gpu_pods = [p for p, pt in enumerate(pts) if pt.gpus > 0]
    trivial = min(total, sum(pt.gpus * pt.count for pt in pts))
    best = float(trivial)
    cols: list[tuple[int, tuple[int, ...]]] = []
    seen: set[tuple[int, tuple[int, ...]]] = set()

    def add(t: int, counts: tuple[int, ...]) -> bool:
        if (t, counts) in seen or not any(counts):
            return False
        seen.add((t, counts))
        cols.append((t, counts))
        return True

    for t, nt in enumerate(nts):  # one pod type alone, as many as fit
        for p in gpu_pods:
            k = pts[p].fits(nt)
            if k:
                add(t, tuple(k if q == p else 0 for q in range(len(pts))))
    for t, c in columns or ():
        add(t, c)
    generate = columns is None
    lp_value = 0.0
    rounds = 0
    converged = not generate
    while cols:
        gpus, a, b = _master(nts, pts, cols)
        res = linprog(-gpus, A_ub=a, b_ub=b, bounds=(0, None), method="highs")
        if res.status != 0:
            raise RuntimeError(f"master LP: {res.message}")
        lp_value = -float(res.fun)
        if not generate:
            break
        rounds += 1
        duals = np.maximum(0.0, -np.asarray(res.ineqlin.marginals))
        u, y = duals[: len(nts)], duals[len(nts) :]
        values = [pt.gpus - y[p] for p, pt in enumerate(pts)]
        # Lagrangian bound, valid for any y >= 0: y.d + sum_t N_t max(0, best config).
        lagrange = float(sum(y[p] * pt.count for p, pt in enumerate(pts)))
        added = 0
        left = max(1.0, time_limit_s - (time.monotonic() - t0))
        for t, nt in enumerate(nts):
            value, upper, counts = _price(nt, pts, values, min(10.0, left))
            lagrange += nt.count * max(0.0, upper)
            if value - u[t] > EPS and add(t, counts):
                added += 1
        best = min(best, lagrange)
        if progress and (rounds % 10 == 0 or not added):
            progress(
                f"round {rounds}: LP {lp_value:.2f} GPUs, bound {best:.2f}, "
                f"{len(cols)} columns, {time.monotonic() - t0:.0f} s"
            )
        if not added:
            converged = True
            break
        if math.floor(best + EPS) <= lp_value + EPS:
            break  # the LP reached the integer bound: more columns cannot lower it
        if rounds >= max_rounds or time.monotonic() - t0 > time_limit_s:
            break
    if not generate:  # the LP over every configuration (all_columns) is the bound
        best = min(best, lp_value)
    bound = min(trivial, math.floor(best + EPS))
    placement, exact = _integer(nts, pts, cols, bound, milp_time_limit_s, seed)
    placed = check(nts, pts, placement)
    if exact:
        bound = min(bound, placed)
    return Solution(
        total_gpus=total,
        lp_gpus=lp_value,
        bound_gpus=bound,
        placed_gpus=placed,
        placement=placement,
        rounds=rounds,
        columns=len(cols),
        converged=converged,
        exact=exact,
        seconds=time.monotonic() - t0,
    )


def _integer(
    nts: Sequence[NodeType],
    pts: Sequence[PodType],
    cols: Sequence[tuple[int, tuple[int, ...]]],
    bound: int,
    time_limit_s: float,
    seed: int,
) -> tuple[Placement, bool]:
    """The master over the generated columns, in integers; each pod left over then goes
    to the node with room and the fewest GPUs free (best fit); then, until the bound is
    reached or time is up, an exact per-node MILP re-places the pods of the nodes with
    free GPUs and of others drawn at random, with every pod left over."""
    t0 = time.monotonic()
    placement: Placement = []
    if cols:
        gpus, a, b = _master(nts, pts, cols)
        res = milp(
            c=-gpus,
            integrality=np.ones(len(cols)),
            bounds=Bounds(0, np.inf),
            constraints=LinearConstraint(a, -np.inf, b),
            options={"time_limit": time_limit_s / 2, "mip_rel_gap": 0.0},
        )
        if res.x is not None:
            for (t, c), x in zip(cols, np.round(res.x).astype(int), strict=True):
                if x > 0:
                    placement.append((t, c, int(x)))
    nodes = _Nodes(nts, pts, placement)
    for p, pt in enumerate(pts):
        if pt.gpus == 0 or nodes.left[p] <= 0:
            continue
        for i in np.argsort(nodes.free[:, 0], kind="stable"):
            if nodes.left[p] == 0:
                break
            k = min(nodes.left[p], nodes.room(int(i), p))
            if k > 0:
                nodes.put(int(i), p, k)
    rng = np.random.default_rng(seed)
    exact = False
    while nodes.gpus() < bound and time.monotonic() - t0 < time_limit_s:
        left = time_limit_s - (time.monotonic() - t0)
        exact = nodes.reoptimise(rng, min(10.0, max(1.0, left)))
        if exact:
            break  # the per-node MILP held every node: the placement is optimal
    merged = Counter((nodes.type[i], tuple(c)) for i, c in enumerate(nodes.counts) if any(c))
    return [(t, c, k) for (t, c), k in sorted(merged.items())], exact


class _Nodes:
    """Single nodes, what each holds and has free, and the pods left over."""

    NEIGHBOURHOOD = 40  # nodes per re-placement: a few thousand integers for HiGHS

    def __init__(self, nts: Sequence[NodeType], pts: Sequence[PodType], placement: Placement):
        self.nts, self.pts = nts, pts
        self.w = _resources(pts)
        self.type: list[int] = []
        self.counts: list[list[int]] = []
        used = [0] * len(nts)
        for t, c, k in placement:
            for _ in range(k):
                self.type.append(t)
                self.counts.append(list(c))
            used[t] += k
        for t, nt in enumerate(nts):
            for _ in range(nt.count - used[t]):
                self.type.append(t)
                self.counts.append([0] * len(pts))
        self.cap = np.array(
            [[nts[t].gpus, nts[t].cpu_milli, nts[t].memory_mib] for t in self.type], float
        ).reshape(-1, 3)
        self.free = self.cap - (np.array(self.counts, float).reshape(len(self.type), -1) @ self.w.T)
        self.left = [pt.count for pt in pts]
        for held in self.counts:
            for p, n in enumerate(held):
                self.left[p] -= n

    def gpus(self) -> int:
        return round(float((self.cap[:, 0] - self.free[:, 0]).sum()))

    def room(self, i: int, p: int) -> int:
        if not self.pts[p].may_run_on(self.nts[self.type[i]]):
            return 0
        need = self.w[:, p]
        return min(int(self.free[i, r] // need[r]) for r in range(3) if need[r] > 0)

    def put(self, i: int, p: int, k: int) -> None:
        self.counts[i][p] += k
        self.left[p] -= k
        self.free[i] -= k * self.w[:, p]

    def reoptimise(self, rng: np.random.Generator, time_limit_s: float) -> bool:
        """Re-place one neighbourhood; True if it held every node and HiGHS proved its
        answer optimal (then no placement allocates more)."""
        slack = [i for i in range(len(self.type)) if self.free[i, 0] > 0]
        others = [i for i in range(len(self.type)) if self.free[i, 0] == 0]
        k = max(0, min(len(others), self.NEIGHBOURHOOD - len(slack)))
        drawn = [int(i) for i in rng.choice(len(others), size=k, replace=False)] if k else []
        hood = slack[: self.NEIGHBOURHOOD] + [others[i] for i in drawn]
        pool = list(self.left)
        for i in hood:
            for p, n in enumerate(self.counts[i]):
                pool[p] += n
        before = sum(self.cap[i, 0] - self.free[i, 0] for i in hood)
        var = [
            (i, p)
            for i in hood
            for p, pt in enumerate(self.pts)
            if pt.gpus > 0 and pool[p] > 0 and pt.fits(self.nts[self.type[i]]) > 0
        ]
        whole = len(hood) == len(self.type)
        if not var:
            return whole
        col = {v: j for j, v in enumerate(var)}
        rows: list[tuple[list[tuple[int, float]], float]] = []
        for p in range(len(self.pts)):
            js = [(col[(i, p)], 1.0) for i in hood if (i, p) in col]
            if js:
                rows.append((js, float(pool[p])))
        for i in hood:
            for r in range(3):
                js = [(col[(i, p)], float(self.w[r, p])) for p in range(len(self.pts))
                      if (i, p) in col]  # fmt: skip
                if js:
                    rows.append((js, float(self.cap[i, r])))
        a = np.zeros((len(rows), len(var)))
        for r_i, (js, _) in enumerate(rows):
            for j, v in js:
                a[r_i, j] = v
        res = milp(
            c=-np.array([float(self.pts[p].gpus) for _, p in var]),
            integrality=np.ones(len(var)),
            bounds=Bounds(0, np.array([float(pool[p]) for _, p in var])),
            constraints=LinearConstraint(a, -np.inf, np.array([b for _, b in rows])),
            options={"time_limit": time_limit_s, "mip_rel_gap": 0.0},
        )
        exact = whole and res.status == 0
        if res.x is None or -float(res.fun) <= before + EPS:
            return exact
        x = np.round(res.x).astype(int)
        new = {i: [0] * len(self.pts) for i in hood}
        for (i, p), v in zip(var, x, strict=True):
            new[i][p] += int(v)
        for i in hood:
            if not _fits(self.nts[self.type[i]], self.pts, new[i]):
                return False  # HiGHS's tolerance let a node overflow: keep what we had
        for i in hood:
            for p, a_old in enumerate(self.counts[i]):
                self.left[p] += a_old
            self.counts[i] = [0] * len(self.pts)
            self.free[i] = self.cap[i].copy()
            for p, v in enumerate(new[i]):
                if v:
                    self.put(i, p, v)
        return exact
