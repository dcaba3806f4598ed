"""Gang tiers and score levels: pure functions of node states and the pod,
and the memo that lets a request reuse the raw scores of nodes that did not change.
`check_node` and `Rejection` live in checks.py and are re-exported here."""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from gpudaemon.cluster.checks import Rejection, check_node
from gpudaemon.cluster.state import NodeState, PodShape

MAX_SCORE = 10  # the extender API's MaxExtenderPriority

# A gang pod's score: its gang tiers (same node as the gang, the whole rest of the gang
# fits, same GPU product), compared first and in that order, then the policy's raw
# score. A preference that must win is an ordered comparison, not a bigger number: no
# constant added to a raw score exceeds every policy's spread (migpack's is 1,000 per
# whole free GPU, fragmentation's grows with the workload).
GangScore = tuple[bool, bool, bool, float]


class _Ordered(Protocol):
    def __lt__(self, other: Any, /) -> bool: ...


# What the ranking functions order: a policy's raw score (float) or a gang pod's
# GangScore, one kind per mapping; higher is better.
Score = TypeVar("Score", bound=_Ordered)


def best(raw: Mapping[str, Score]) -> str | None:
    """The pick: the highest score, ties broken by node name, so the extender and
    every replica of it agree on one node."""
    if not raw:
        return None
    top = max(raw.values())
    return min(n for n, v in raw.items() if v == top)


def best_nodes(raw: Mapping[str, Score], k: int) -> list[str]:
    """The `k` best nodes, best first, in `best`'s order (ties by node name).

    Grouped by value first: a request has few distinct raw scores and many nodes."""
    groups: dict[Score, list[str]] = {}
    for n, v in raw.items():
        groups.setdefault(v, []).append(n)
    out: list[str] = []
    for v in heapq.nlargest(k, groups):
        out.extend(heapq.nsmallest(k - len(out), groups[v]))
        if len(out) >= k:
            break
    return out


def to_levels(raw: Mapping[str, Score]) -> dict[str, int]:
    """Map raw scores onto 0..10 by rank, not linearly, with the pick alone on top.

    Tiers: the pick (`best`), then the nodes that tie with it, then each lower distinct
    raw score; tier i gets level 10 - i, and tiers past the tenth get 0. A linear map
    would squeeze the best nodes together when one node is far worse (11 levels,
    5,000 nodes). The pick alone at 10 makes the scheduler's choice (the top total
    score; random among ties) the node the extender assumes the pod on, as long as the
    in-tree scores do not differ; equally good nodes stay one level below, so in-tree
    preferences can still choose among them.
    """
    top, by_value = rank(raw)
    levels = {n: by_value.get(v, 0) for n, v in raw.items()}
    if top is not None:
        levels[top] = MAX_SCORE
    return levels


def rank(raw: Mapping[str, Score]) -> tuple[str | None, dict[Score, int]]:
    """(`best`, the level of each raw value that earns one): the pieces of `to_levels`,
    for the request path to apply in the one pass that writes its answer. The pick
    gets MAX_SCORE whatever its value's level says."""
    top = best(raw)
    if top is None:
        return None, {}
    values = list(raw.values())
    top_value = raw[top]
    gap = 1 if values.count(top_value) > 1 else 0  # nodes tied with the pick: level 9
    # Only the top eleven distinct values can get a level above 0.
    distinct = heapq.nlargest(MAX_SCORE + 1, set(values))
    return top, {v: MAX_SCORE - i - gap for i, v in enumerate(distinct) if i + gap < MAX_SCORE}


@dataclass(frozen=True, slots=True)
class Gang:
    """What a gang pod's ranking knows of its gang, gathered by the `gang` plug-in's
    PreFilter (cluster/plugins/gang.py)."""

    held: Collection[str]  # nodes holding some of the gang (bound or assumed)
    products: frozenset[str]  # the GPU products of those nodes
    gpus_to_place: int  # GPUs of the gang still to place, this pod's included
    pod_gpus: int  # this pod's


def gang_scores(
    raw: Mapping[str, float], states: Mapping[str, NodeState | None], gang: Gang
) -> dict[str, GangScore]:
    """A gang pod's scores: (same node as the gang, the whole rest of the gang fits,
    same GPU product, the policy's raw score), ordered as tuples.

    A node already holding some of the gang comes first; else one with room for all of
    the gang still to place (only when pods of it remain besides this one), so the gang
    starts where it can finish; within each, nodes of the product the gang already has
    before others. The policy's raw score only orders nodes within a tier, so
    bin-packing picks the fullest node of the best tier, whatever its spread."""
    held, products = gang.held, gang.products
    need = gang.gpus_to_place if gang.gpus_to_place > gang.pod_gpus else None
    out: dict[str, GangScore] = {}
    for name, v in raw.items():  # every node of every gang pod's request: kept lean
        st = states.get(name)
        if st is None:
            out[name] = (name in held, False, False, v)
        elif name in held:
            out[name] = (True, False, st.gpu_model in products, v)
        else:
            whole = need is not None and st.gpus_free >= need
            out[name] = (False, whole, st.gpu_model in products, v)
    return out


# Any pod's score when some node has a free degraded GPU: (the node can give the pod
# enough free GPUs that are not degraded, its score as before). Compared first, as the
# gang tiers are, and for the same reason: a preference that must win whatever the
# policies' spread (issue 30).
HealthScore = tuple[bool, Any]


def prefer_healthy(
    ranked: Mapping[str, Score],
    states: Mapping[str, NodeState | None],
    degraded: Collection[str],
    gpus: int,
) -> Mapping[str, Any]:
    """A node that can give the pod `gpus` free GPUs that are not degraded ranks above
    one that would have to use a degraded GPU; within each group, the order of `ranked`
    (the policy's, or a gang's tiers). `degraded`: the nodes with a free degraded GPU.
    When none of them has to be demoted (or the pod wants no whole GPU), `ranked` comes
    back unchanged: the same answers as without this, at the cost of one lookup per
    degraded node.

    A policy's raw scores (floats) are not made tuples: the few demoted nodes are moved
    below the lowest score, keeping their order (x - lo is monotonic), so the other
    nodes keep their exact values and ranking compares floats, not 5,000 tuples. A
    gang's tuples get the tier in front (`HealthScore`)."""
    if gpus <= 0 or not degraded:
        return ranked
    demoted = [
        n
        for n in degraded
        if n in ranked and (st := states.get(n)) is not None and not st.clean_fit(gpus)
    ]
    if not demoted:
        return ranked
    if isinstance(ranked[demoted[0]], tuple):
        low = set(demoted)
        return {n: (n not in low, v) for n, v in ranked.items()}
    values: list[float] = list(ranked.values())  # type: ignore[arg-type]
    lo, hi = min(values), max(values)
    gap = max(1.0, abs(lo) * 1e-9)  # 1 would vanish below a huge score
    below = lo - gap - (hi - lo)  # every demoted score lands in [below, lo - gap]
    out: dict[str, float] = dict(ranked)  # type: ignore[arg-type]
    for n in demoted:
        out[n] = below + (out[n] - lo)
    return out


class Scorer(Protocol):
    """What the memo scores with: a policy, or any score plug-in's scorer (only the
    order of raw scores matters; `scores_version` moves when the same node and pod may
    score differently)."""

    @property
    def name(self) -> str: ...

    def raw_score(self, node: NodeState, pod: PodShape) -> float: ...

    def scores_version(self) -> object: ...


class ScoreMemo:
    """Raw scores by node, reused while the node's state and the policy's tables stay
    the same.

    Between two pods of a burst only the nodes that took a pod change, yet every
    request names every node: recomputing 5,000 scores per request is most of the
    extender's CPU, and that CPU is taken from the scheduler and the API server on the
    same machine. A `NodeState` is immutable and replaced whenever its node or its pods
    change, so the state object itself is the key (an identity check, not a
    comparison); `Policy.scores_version` covers what the policy learned. One memo per
    (policy, pod shape), the `max_shapes` most recently used kept. Not thread-safe:
    the API calls it under its decision lock.
    """

    def __init__(self, max_shapes: int = 16, max_nodes: int = 100_000) -> None:
        self.max_shapes = max_shapes
        self.max_nodes = max_nodes  # per shape: node names come and go
        self._memos: OrderedDict[
            tuple[str, PodShape], tuple[object, dict[str, tuple[NodeState, float | None]]]
        ] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def scores(
        self,
        policy: Scorer,
        shape: PodShape,
        names: Iterable[str],
        states: Mapping[str, NodeState | None],
    ) -> dict[str, float]:
        """Raw scores of the named nodes that can host the pod (others are left out)."""
        key = (policy.name, shape)
        version = policy.scores_version()
        entry = self._memos.get(key)
        if entry is None or entry[0] != version or len(entry[1]) > self.max_nodes:
            entry = self._memos[key] = (version, {})
        self._memos.move_to_end(key)
        if len(self._memos) > self.max_shapes:
            self._memos.popitem(last=False)
        memo = entry[1]
        out: dict[str, float] = {}
        hits = misses = 0
        for name in names:
            st = states.get(name)
            if st is None:
                continue
            hit = memo.get(name)
            if hit is not None and hit[0] is st:
                hits += 1
                raw = hit[1]
            else:
                misses += 1
                raw = policy.raw_score(st, shape) if st.can_host(shape) else None
                if raw is not None and not math.isfinite(raw):
                    raw = None  # a score that orders nothing: the node is left unscored
                memo[name] = (st, raw)
            if raw is not None:
                out[name] = raw
        self.hits += hits
        self.misses += misses
        return out


__all__ = [
    "MAX_SCORE",
    "Gang",
    "GangScore",
    "HealthScore",
    "Rejection",
    "ScoreMemo",
    "Scorer",
    "best",
    "best_nodes",
    "check_node",
    "gang_scores",
    "prefer_healthy",
    "rank",
    "to_levels",
]
