"""Each node's verdict for a pod shape, kept between requests and redone only for the
nodes that changed: the extender's answer at fleet scale.

kube-scheduler names every feasible node in each request (5,000 at fleet scale), and
between two requests only a few nodes change: a pod bound or assumed, an agent's
annotation or Lease. Judging every node again per request is a loop of Python per node
per filter and per score; here a `VerdictTable` per (score plug-in, pod shape, filters)
keeps, for each node, the state and freshness deadline it was judged with, the first
filter's rejection, and the raw score, with the scored nodes grouped by value (the
ranking reads the best groups, not every node). A request asks `ClusterState.changes`
for the nodes changed since the table's cursor and judges those again, plus the nodes
whose freshness deadline has passed since. The answers are the framework's general
path's, node for node: the same filters run in the same order on the same states, and
the same raw scores are ranked by the same rules (framework.py checks when this path
applies: pure filters, one score plug-in, no gang, no degraded GPU, no DRA claim).
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from gpudaemon.cluster.checks import Rejection
from gpudaemon.cluster.clusterstate import ClusterState, Cursor
from gpudaemon.cluster.plugins.base import NodeFilter
from gpudaemon.cluster.scoring import MAX_SCORE, Scorer
from gpudaemon.cluster.state import NodeState, PodShape

_NEVER = float("-inf")
_UNSET = object()  # no scores version seen yet


@dataclass
class FastFilter:
    passed: list[str]
    failed: dict[str, str]  # node -> its rejection, described
    reasons: Counter[str]  # the rejections' reasons, counted
    outranked: int | None  # None: not narrowed to the candidates
    states: dict[str, NodeState | None]  # of the nodes passed, when only one passed


class VerdictTable:
    """One (score plug-in, pod shape, filters)'s verdict per node. Not thread-safe: the
    framework uses it under its decision lock."""

    def __init__(
        self, scorer: Scorer | None, shape: PodShape, describe: Callable[[Rejection], str]
    ) -> None:
        self.scorer, self.shape, self.describe = scorer, shape, describe
        self.cursor: Cursor | None = None
        self.version: object = _UNSET
        self.entries: dict[str, tuple[NodeState | None, float]] = {}  # (state, until)
        self.failed: dict[str, Rejection] = {}  # the first filter's rejection
        self.messages: dict[str, str] = {}  # the same, described for FailedNodes
        self.reasons: Counter[str] = Counter()  # their reasons, counted
        # The last request's names (a scheduler sends the same list again and again):
        # compared as a list, it spares building a set of 5,000 names per request.
        self._names: list[str] = []
        self._nameset: set[str] = set()
        self._names_gen = 0
        self._missing: set[str] = set()  # named, not judged yet
        self._gen = 0  # moves whenever a score does
        self._score_answer: tuple[int, int, str | None, list[int]] | None = None
        self.raw: dict[str, float] = {}  # scored nodes, whatever their verdict
        self.groups: dict[float, set[str]] = {}  # raw score -> its nodes
        self.values: list[float] = []  # the keys of `groups`, ascending
        self._expiry: list[tuple[float, str]] = []  # (until, node) of nodes judged fresh
        # A scorer that splits its raw score (fragmentation: score_parts, key_score)
        # is rescored, when it learns, with one lookup per node key, not per node.
        split = scorer is not None and hasattr(scorer, "score_parts")
        self._parts_of = getattr(scorer, "score_parts", None) if split else None
        self._key_score = getattr(scorer, "key_score", None) if split else None
        self.parts: dict[str, tuple[Hashable, float]] = {}  # node -> (key, tie-break)
        self._alike: dict[tuple[Hashable, float], set[str]] = {}  # parts -> their nodes
        self._states_scored: dict[str, NodeState] = {}  # without parts: node -> state
        self._base: dict[Hashable, float | None] = {}  # key -> key_score, this version
        self.judged = 0  # nodes judged (for tests and benchmarks)

    # -- keeping up -------------------------------------------------------------------

    def named(self, names: list[str]) -> set[str] | None:
        """The request's names as a set; None when one is named twice (the general
        path answers that)."""
        if names == self._names:
            return self._nameset
        nameset = set(names)
        if len(nameset) != len(names):
            return None
        self._names, self._nameset = list(names), nameset
        self._names_gen += 1
        self._missing = nameset - self.entries.keys()
        return nameset

    def update(
        self,
        cluster: ClusterState,
        filters: Sequence[NodeFilter],
        names: set[str],
        now: float,
    ) -> bool:
        """Judge again what changed since the last update, and the names (`named`)
        not judged yet; False when some node has a free degraded GPU (the general
        path ranks then: scoring.prefer_healthy)."""
        missing, self._missing = self._missing, set()
        ch = cluster.changes(self.cursor, missing)
        self.cursor = ch.cursor
        if ch.changed is None:
            self._clear()
        todo: dict[str, tuple[NodeState | None, float]] = {
            n: (st, ch.until[n]) for n, st in ch.states.items()
        }
        if ch.changed is None:  # every node the cluster knows was given: the rest are not
            for n in names - todo.keys():
                todo[n] = (None, _NEVER)
        heap = self._expiry
        while heap and heap[0][0] <= now:
            until, n = heapq.heappop(heap)
            entry = self.entries.get(n)
            if n not in todo and entry is not None and entry[1] == until:
                todo[n] = entry  # its data went stale since it was judged
        version = self.scorer.scores_version() if self.scorer is not None else None
        rescore = version != self.version
        self.version = version
        if rescore:
            self._base = {}
        if todo:
            self._judge(todo, filters, now, rescore)
        if rescore:
            self._rescore_all()
        if self.scorer is not None and self.scorer.scores_version() != version:
            self.version = _UNSET  # it learned while we scored: all again next time
        return not ch.degraded

    def _clear(self) -> None:
        self.entries.clear()
        self.failed.clear()
        self.messages.clear()
        self.reasons.clear()
        self._gen += 1
        self.raw.clear()
        self.parts.clear()
        self._alike.clear()
        self._states_scored.clear()
        self.groups.clear()
        self.values.clear()
        self._expiry.clear()

    def _judge(
        self,
        todo: dict[str, tuple[NodeState | None, float]],
        filters: Sequence[NodeFilter],
        now: float,
        rescore: bool,
    ) -> None:
        batch = list(todo)
        states = {n: e[0] for n, e in todo.items()}
        fresh = {n: now < e[1] for n, e in todo.items()}
        rejected: dict[str, Rejection] = {}
        passed = batch
        for run in filters:  # in order, each on what the ones before passed
            passed = run(passed, states, fresh, rejected)
        self.judged += len(batch)
        entries, failed, reasons = self.entries, self.failed, self.reasons
        for n in batch:
            st, until = todo[n]
            old = entries.get(n)
            entries[n] = (st, until)
            why = rejected.get(n)
            was = failed.pop(n, None)
            if was is not None:
                reasons[was.reason] -= 1
                del self.messages[n]
            if why is not None:
                failed[n] = why
                reasons[why.reason] += 1
                self.messages[n] = self.describe(why)
            if fresh[n]:
                heapq.heappush(self._expiry, (until, n))
            if old is None or old[0] is not st:
                self._set_parts(n, st)
                if not rescore:
                    self._set_raw(n, self._score(n))
        if len(self._expiry) > 4 * len(entries) + 1024:  # superseded deadlines
            self._expiry = [(e[1], n) for n, e in entries.items() if now < e[1]]
            heapq.heapify(self._expiry)

    def _set_parts(self, n: str, st: NodeState | None) -> None:
        """What the node's score is made of: the scorer's version-free parts, or its
        state (the scorer asked when scoring). Only a node that can host the pod."""
        old = self.parts.pop(n, None)
        if old is not None:
            alike = self._alike[old]
            alike.discard(n)
            if not alike:
                del self._alike[old]
        if st is None or self.scorer is None or not st.can_host(self.shape):
            self._states_scored.pop(n, None)
        elif self._parts_of is not None:
            parts = self._parts_of(st, self.shape)
            # A tie-break that is not finite: so is the raw score, whatever the key's part.
            if math.isfinite(parts[1]):
                self.parts[n] = parts
                self._alike.setdefault(parts, set()).add(n)
        else:
            self._states_scored[n] = st

    def _score(self, n: str) -> float | None:
        """ScoreMemo's rule: only a node that can host the pod, with a finite score."""
        raw: float | None = None
        parts = self.parts.get(n)
        if parts is not None and self._key_score is not None:
            key, tie = parts
            if key in self._base:
                base = self._base[key]
            else:
                base = self._key_score(key, self.shape)
                if base is not None and not math.isfinite(base):
                    base = None
                self._base[key] = base
            if base is not None:
                raw = base + tie
        elif self.scorer is not None and (st := self._states_scored.get(n)) is not None:
            raw = self.scorer.raw_score(st, self.shape)
        return raw if raw is not None and math.isfinite(raw) else None

    def _set_raw(self, n: str, raw: float | None) -> None:
        if raw is not None and self.raw.get(n) == raw:
            return
        self._gen += 1
        old = self.raw.pop(n, None)
        if old is not None:
            group = self.groups[old]
            group.discard(n)
            if not group:
                del self.groups[old]
                del self.values[bisect.bisect_left(self.values, old)]
        if raw is not None:
            self.raw[n] = raw
            into = self.groups.get(raw)
            if into is None:
                self.groups[raw] = {n}
                bisect.insort(self.values, raw)
            else:
                into.add(n)

    def _rescore_all(self) -> None:
        """The scorer's tables changed (it learned): every node's score again."""
        self._gen += 1
        if self._parts_of is not None and self._key_score is not None:
            # One key_score per distinct key, one sum per set of nodes with equal parts
            # (a fleet has few node kinds); finite base plus finite tie-break: finite.
            ks, shape, base = self._key_score, self.shape, self._base
            scores: dict[str, float] = {}
            by_value: dict[float, set[str]] = {}
            for (key, tie), nodes in self._alike.items():
                if key in base:
                    b = base[key]
                else:
                    b = ks(key, shape)
                    b = base[key] = b if b is not None and math.isfinite(b) else None
                if b is None:
                    continue
                r = b + tie
                scores.update(dict.fromkeys(nodes, r))
                into = by_value.get(r)
                if into is None:
                    by_value[r] = set(nodes)
                else:
                    into |= nodes
            self.raw, self.groups, self.values = scores, by_value, sorted(by_value)
            return
        else:
            score = self._score
            self.raw = {n: raw for n in self._states_scored if (raw := score(n)) is not None}
        groups: dict[float, set[str]] = {}
        for n, raw in self.raw.items():
            group = groups.get(raw)
            if group is None:
                groups[raw] = {n}
            else:
                group.add(n)
        self.groups = groups
        self.values = sorted(groups)

    # -- answers --------------------------------------------------------------------------

    def filter(self, names: list[str], nameset: set[str], candidates: int) -> FastFilter:
        """framework.filter's answer: the nodes that pass every filter, narrowed to the
        `candidates` best by score (ties by name) when more pass, topped up with
        unscored passing nodes in request order."""
        same = len(self.entries) == len(nameset)  # every node judged is named
        failed = self.failed
        if same:
            named_failed, reasons = self.messages, self.reasons
        else:
            named_failed = {n: m for n, m in self.messages.items() if n in nameset}
            reasons = Counter(failed[n].reason for n in named_failed)
        n_passed = len(names) - len(named_failed)
        keep: list[str] = []
        if 0 < candidates < n_passed and self.scorer is not None:
            for v in reversed(self.values):
                members = [n for n in self.groups[v] if n not in failed and (same or n in nameset)]
                if members:
                    keep.extend(heapq.nsmallest(candidates - len(keep), members))
                    if len(keep) >= candidates:
                        break
        if keep:
            if len(keep) < candidates:  # fill up with the unscored ones, in request order
                raw = self.raw
                keep += [n for n in names if n not in named_failed and n not in raw][
                    : candidates - len(keep)
                ]
            outranked, passed = n_passed - len(keep), keep
        else:
            outranked, passed = None, [n for n in names if n not in named_failed]
        states = {passed[0]: self.entries[passed[0]][0]} if len(passed) == 1 else {}
        return FastFilter(passed, dict(named_failed), +reasons, outranked, states)

    def score(self, names: list[str], nameset: set[str]) -> tuple[str | None, list[int]]:
        """framework.score's answer: (the pick, each named node's 0..10), as
        scoring.rank maps the raw scores of the named nodes that can host the pod."""
        cached = self._score_answer
        if cached is not None and cached[:2] == (self._gen, self._names_gen):
            return cached[2], cached[3]  # nothing moved since the same request
        same = len(self.entries) == len(nameset)
        top: str | None = None
        gap = 0
        distinct: list[float] = []
        for v in reversed(self.values):
            group = self.groups[v]
            if not same:
                group = {n for n in group if n in nameset}
                if not group:
                    continue
            if top is None:
                top = min(group)
                gap = 1 if len(group) > 1 else 0
            distinct.append(v)
            if len(distinct) > MAX_SCORE:
                break
        level = {v: MAX_SCORE - i - gap for i, v in enumerate(distinct) if i + gap < MAX_SCORE}
        get = self.raw.get
        scores = [MAX_SCORE if n == top else level.get(get(n, _NEVER), 0) for n in names]
        self._score_answer = (self._gen, self._names_gen, top, scores)
        return top, scores


class VerdictTables:
    """The tables, one per (score plug-in, pod shape, filters), the most recently used
    `max_tables` kept."""

    def __init__(self, describe: Callable[[Rejection], str], max_tables: int = 16) -> None:
        self.describe = describe
        self.max_tables = max_tables
        self._tables: OrderedDict[tuple[object, ...], VerdictTable] = OrderedDict()

    def get(self, scorer: Scorer | None, shape: PodShape, filters: tuple[str, ...]) -> VerdictTable:
        key = (scorer.name if scorer is not None else None, shape, filters)
        table = self._tables.get(key)
        if table is None or table.scorer is not scorer:
            table = self._tables[key] = VerdictTable(scorer, shape, self.describe)
        self._tables.move_to_end(key)
        if len(self._tables) > self.max_tables:
            self._tables.popitem(last=False)
        return table


__all__ = ["FastFilter", "VerdictTable", "VerdictTables"]
