"""The plug-in interfaces and the one table every plug-in adds itself to.

As kube-scheduler's framework (`pkg/scheduler/framework/plugins/registry.go`): a
plug-in is one module under `extender/plugins/` that calls `register(PluginSpec(...))`
with its name, its kind (filter, score or reserve), a factory and a one-line summary.
The `extender.plugins` config section enables plug-ins by name, in order, with a
weight for each score plug-in; an unknown name is a ConfigError at start (exit 2).

- **filter**: `prepare(cycle)` returns this pod's `NodeFilter` (None: nothing to
  check, e.g. no reservation in force). The framework runs them in order, each on the
  nodes the ones before it passed, so a node's reason is the first `Rejection`. A
  filter is given the whole list, not one node, so a check can run as one tight loop
  over 5,000 nodes; `per_node` makes one from a plain per-node check.
- **score**: `scorer(cycle)` returns what scores this pod's nodes (a `Scorer`: a
  policy, or the plug-in itself), or None to stay out for this pod. The framework
  memoizes raw scores (scoring.ScoreMemo), normalises each plug-in's to 0..MAX_NODE_SCORE
  and sums them with the weights.
- **reserve**: `reserve(uid, node, shape, gang)` when the framework places a pod.

Every registered policy (cluster/policies/) is also a score plug-in under its own
name, scoring every pod by that policy; `policy` scores each pod by its own policy
(its gpudaemon.io/policy annotation, else migpack for MIG-only pods, else
`extender.policy`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from gpudaemon.cluster.checks import Rejection
from gpudaemon.cluster.clusterstate import ClusterState
from gpudaemon.cluster.policies.base import Policy, known_policies
from gpudaemon.cluster.reservations import LeaseReservations
from gpudaemon.cluster.scoring import Scorer
from gpudaemon.cluster.state import NodeState, PodShape
from gpudaemon.config import PluginsConfig
from gpudaemon.errors import ConfigError
from gpudaemon.extender.pods import PendingPods

Kind = Literal["filter", "score", "reserve"]
KINDS: tuple[Kind, ...] = ("filter", "score", "reserve")
# Each score plug-in's scores are mapped onto 0..this before the weighted sum
# (kube-scheduler's MaxNodeScore); the sum is then ranked onto the extender's 0..10.
MAX_NODE_SCORE = 100.0


@dataclass(frozen=True, slots=True)
class Cycle:
    """What one request knows of its pod (kube-scheduler's CycleState)."""

    pod: Mapping[str, Any]  # the request body's pod
    shape: PodShape  # its requests (the verified pod's when there is one)
    policy: Policy  # its policy (annotation, MIG, default)
    uid: str  # "" when the pod cannot be placed (unverified, or no UID)
    now: float  # wall clock, for reservations


class Handle(Protocol):
    """What a plug-in's factory may use: the framework's shared state."""

    cluster: ClusterState
    policies: dict[str, Policy]
    avoid_unhealthy: bool
    pending: PendingPods | None
    reservations: LeaseReservations | None


# (the node's state, None when unknown; whether its agent data is fresh) -> why not
NodeCheck = Callable[[NodeState | None, bool], Rejection | None]
# (nodes to judge, states by node, freshness by node, rejections to add to) -> the nodes
# that pass, in the order given; each one left out gets its Rejection in the dict.
NodeFilter = Callable[
    [list[str], Mapping[str, NodeState | None], Mapping[str, bool], dict[str, Rejection]],
    list[str],
]


def per_node(check: NodeCheck) -> NodeFilter:
    """A `NodeFilter` from a per-node check: the simple way to write a filter plug-in."""

    def run(
        names: list[str],
        states: Mapping[str, NodeState | None],
        fresh: Mapping[str, bool],
        failed: dict[str, Rejection],
    ) -> list[str]:
        out = []
        for n in names:
            why = check(states[n], fresh[n])
            if why is None:
                out.append(n)
            else:
                failed[n] = why
        return out

    return run


class FilterPlugin(Protocol):
    @property
    def name(self) -> str: ...

    def prepare(self, cycle: Cycle) -> NodeFilter | None: ...


class ScorePlugin(Protocol):
    @property
    def name(self) -> str: ...

    def scorer(self, cycle: Cycle) -> Scorer | None: ...


class ReservePlugin(Protocol):
    @property
    def name(self) -> str: ...

    def reserve(self, uid: str, node: str, shape: PodShape, gang: str) -> None: ...


class NodeScore:
    """The base of a score plug-in that is its own scorer: a pure `raw_score` of node
    and pod (higher is better, only the order matters), learning nothing."""

    name = ""
    scores_gpuless_pods = False  # a pod asking for no GPU: stay out of its ranking

    def scorer(self, cycle: Cycle) -> Scorer | None:
        return self if cycle.shape.wants_gpus or self.scores_gpuless_pods else None

    def raw_score(self, node: NodeState, pod: PodShape) -> float:
        raise NotImplementedError

    def scores_version(self) -> object:
        return 0


@dataclass(frozen=True)
class PluginSpec:
    name: str
    kind: Kind
    factory: Callable[[Handle], Any]  # builds the plug-in for one framework
    summary: str  # one line, for the docs table


_REGISTRY: dict[tuple[Kind, str], PluginSpec] = {}
_LOCK = threading.Lock()


def register(spec: PluginSpec) -> PluginSpec:
    """Add a plug-in; a second one under the same kind and name is a bug, refused."""
    with _LOCK:
        key = (spec.kind, spec.name)
        if key in _REGISTRY and _REGISTRY[key] is not spec:
            raise ValueError(f"{spec.kind} plug-in {spec.name!r} is registered twice")
        _REGISTRY[key] = spec
    return spec


def unregister(kind: Kind, name: str) -> None:
    """For tests that register a plug-in of their own."""
    with _LOCK:
        _REGISTRY.pop((kind, name), None)


def known_plugins(kind: Kind) -> list[str]:
    with _LOCK:
        names = {n for k, n in _REGISTRY if k == kind}
    if kind == "score":
        names |= set(known_policies())
    return sorted(names)


class UnknownPluginError(ConfigError):
    def __init__(self, kind: Kind, name: str) -> None:
        super().__init__(
            f"extender.plugins.{kind}: unknown {kind} plug-in {name!r}"
            f" (known: {', '.join(known_plugins(kind))})"
        )


def plugin_spec(kind: Kind, name: str) -> PluginSpec:
    with _LOCK:
        spec = _REGISTRY.get((kind, name))
    if spec is not None:
        return spec
    if kind == "score" and name in known_policies():
        return PluginSpec(name, "score", lambda h: FixedPolicy(h.policies[name]), "a policy")
    raise UnknownPluginError(kind, name)


class FixedPolicy:
    """A policy as a score plug-in under its own name: it scores every pod, whatever
    the pod's annotation says."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.name = policy.name

    def scorer(self, cycle: Cycle) -> Scorer | None:
        p = self.policy
        return p if cycle.shape.wants_gpus or p.scores_gpuless_pods else None


@dataclass(frozen=True)
class Profile:
    """The enabled plug-ins, in their configured order."""

    filters: tuple[FilterPlugin, ...]
    scores: tuple[tuple[ScorePlugin, int], ...]  # (plug-in, weight)
    reserves: tuple[ReservePlugin, ...]


def check_plugins(cfg: PluginsConfig) -> None:
    """Every name in `extender.plugins` is registered: a ConfigError naming the known
    ones otherwise (the extender checks at start, before any API call)."""
    for name in cfg.filter:
        plugin_spec("filter", name)
    for s in cfg.score:
        plugin_spec("score", s.name)
    for name in cfg.reserve:
        plugin_spec("reserve", name)


def build_profile(cfg: PluginsConfig, handle: Handle) -> Profile:
    def build(kind: Kind, names: Sequence[str]) -> tuple[Any, ...]:
        return tuple(plugin_spec(kind, n).factory(handle) for n in names)

    scores = build("score", [s.name for s in cfg.score])
    return Profile(
        build("filter", cfg.filter),
        tuple(zip(scores, (s.weight for s in cfg.score), strict=True)),
        build("reserve", cfg.reserve),
    )
