"""The plug-in interfaces, the cycle state they share and a plug-in's description.

As kube-scheduler's framework: a plug-in is one module under `cluster/plugins/`
with a class that implements one or more extension points, and a `PluginSpec` naming
it, its kind, its arguments and a one-line summary. `registry.py` lists every spec in
one table; the `extender.plugins` config section enables plug-ins by name, in order,
for the extender (extender/framework.py) and for the rebalancer's placement
(rebalancer/planner.py `Placer`), so both place a pod by the same rules.

- **PreFilter**: `pre_filter(state)`, once per request, before anything else, for every
  enabled plug-in that has it: what the later steps need of the pod, computed once and
  written into the `CycleState` under the plug-in's own `StateKey`.
- **filter**: `filter(state)` returns this pod's `NodeFilter` (None: nothing to
  check, e.g. no reservation in force). The framework runs them in order, each on the
  nodes the ones before it passed, so a node's reason is the first `Rejection`. A
  filter is given the whole list, not one node, so a check can run as one tight loop
  over 5,000 nodes; `per_node` makes one from a plain per-node check.
- **score**: `scorer(state)` returns what scores this pod's nodes (a `Scorer`: a
  policy, or the plug-in itself), or None to stay out for this pod. The framework
  memoizes raw scores (scoring.ScoreMemo), normalises each plug-in's to 0..MAX_NODE_SCORE
  and sums them with the weights.
- **tier** (a score plug-in compared in order, not summed): `order(state, scores,
  snapshot)` puts its preference in front of the scores it is given (the weighted sum,
  or the tiers after it), so no weight can outvote it; `has_say(state, degraded)` says
  whether it may reorder this pod's nodes at all (when none may, the verdict tables
  answer).
- **reserve**: `reserve(state, node)` when the framework places the pod on `node`.

Each plug-in gets its own arguments (`PluginSpec.args`, a pydantic model): the
plug-in's section under `extender.plugins.args`, over defaults the framework's
handle gives from the older top-level keys (`avoid_unhealthy_nodes`, ...).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, NamedTuple, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict

from gpudaemon.cluster.checks import Rejection
from gpudaemon.cluster.clusterstate import ClusterState, Snapshot
from gpudaemon.cluster.policies.base import Policy
from gpudaemon.cluster.reservations import KeptRooms
from gpudaemon.cluster.scoring import Scorer
from gpudaemon.cluster.state import NodeState, PodShape

Kind = Literal["filter", "score", "tier", "reserve"]
KINDS: tuple[Kind, ...] = ("filter", "score", "tier", "reserve")
# Each score plug-in's scores are mapped onto 0..this before the weighted sum
# (kube-scheduler's MaxNodeScore); the sum is then ranked onto the extender's 0..10.
MAX_NODE_SCORE = 100.0

T = TypeVar("T")


class StateKey(Generic[T]):
    """A typed key into the `CycleState`: `state.read(KEY)` is a `T`. Compared by
    identity, so two plug-ins never share a key by choosing the same name."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"StateKey({self.name!r})"


class MissingStateError(LookupError):
    """A plug-in read a key no PreFilter wrote (a bug: a plug-in that needs another's
    state without it enabled)."""


class CycleState:
    """One request's state (kube-scheduler's CycleState): written by PreFilter, read by
    the later steps of the same request. Not shared between requests."""

    __slots__ = ("_data",)

    def __init__(self) -> None:
        self._data: dict[StateKey[Any], Any] = {}

    def write(self, key: StateKey[T], value: T) -> None:
        self._data[key] = value

    def read(self, key: StateKey[T]) -> T:
        try:
            return self._data[key]  # type: ignore[no-any-return]
        except KeyError:
            raise MissingStateError(f"cycle state has no {key.name!r}") from None

    def get(self, key: StateKey[T]) -> T | None:
        return self._data.get(key)


class RealPod(NamedTuple):
    """The real pod behind a request's body (verified, or trusted in tests and
    benchmarks): only such a pod is reserved."""

    uid: str
    shape: PodShape  # its requests, claims included
    gang: str  # "" when it belongs to none


@dataclass(frozen=True, slots=True)
class Cycle:
    """What one request knows of its pod, written by the framework under `POD` before
    the PreFilter plug-ins run."""

    pod: Mapping[str, Any]  # the request body's pod
    shape: PodShape  # its requests, as the body gives them
    policy: Policy  # its policy (annotation, MIG, default)
    uid: str  # "" when the pod cannot be placed (unverified, or no UID)
    now: float  # wall clock, for reservations
    real: RealPod | None = None  # None: nothing is reserved or learned for it


POD: StateKey[Cycle] = StateKey("pod")
# Written by a PreFilter whose verdicts depend on more of the pod than its requests and
# policy (`reserved` with a room in force: its priority, and its UID when a room is its
# own): that more, as a hashable value. A caller that judges pods by kind (the
# rebalancer's Placer) judges pods alike only when they give the same value.
BY_POD: StateKey[Hashable] = StateKey("by_pod")


class PendingPod(Protocol):
    """A pending pod as the program that keeps them knows it (the extender's
    `extender.pods.RealPod`)."""

    @property
    def uid(self) -> str: ...

    @property
    def shape(self) -> PodShape: ...

    @property
    def priority(self) -> int: ...


class PendingView(Protocol):
    """The pending pods of this scheduler, by UID and by gang (the extender's
    `extender.pods.PendingPods`, fed by its verifier's watch)."""

    def get(self, uid: str) -> PendingPod | None: ...

    def gang_members(self, gang: str) -> Sequence[PendingPod]: ...


class Handle(Protocol):
    """What a plug-in's factory may use: the program's shared state, and the older
    top-level keys that give plug-ins their default arguments. `pending`: the program's
    pending pods; `reservations`: the rooms the rebalancer keeps, as the program knows
    them (the extender: from the rebalancer's Lease; the rebalancer: its own). None
    where a program has none: the plug-ins that read them then have no say."""

    @property
    def cluster(self) -> ClusterState: ...

    @property
    def policies(self) -> dict[str, Policy]: ...

    @property
    def avoid_unhealthy(self) -> bool: ...

    @property
    def prefer_healthy_gpus(self) -> bool: ...

    @property
    def pending(self) -> PendingView | None: ...

    @property
    def reservations(self) -> KeptRooms | None: ...


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


class PreFilterPlugin(Protocol):
    @property
    def name(self) -> str: ...

    def pre_filter(self, state: CycleState) -> None: ...


class FilterPlugin(Protocol):
    @property
    def name(self) -> str: ...

    def filter(self, state: CycleState) -> NodeFilter | None: ...


class ScorePlugin(Protocol):
    @property
    def name(self) -> str: ...

    def scorer(self, state: CycleState) -> Scorer | None: ...


class TierPlugin(Protocol):
    @property
    def name(self) -> str: ...

    def has_say(self, state: CycleState, degraded: bool) -> bool: ...

    def order(
        self, state: CycleState, scores: Mapping[str, Any], snap: Snapshot
    ) -> Mapping[str, Any]: ...


class ReservePlugin(Protocol):
    @property
    def name(self) -> str: ...

    def reserve(self, state: CycleState, node: str) -> None: ...


class NodeScore:
    """The base of a score plug-in that is its own scorer: a pure `raw_score` of node
    and pod (higher is better, only the order matters), learning nothing."""

    name = ""
    scores_gpuless_pods = False  # a pod asking for no GPU: stay out of its ranking

    def scorer(self, state: CycleState) -> Scorer | None:
        wants = state.read(POD).shape.wants_gpus
        return self if wants or self.scores_gpuless_pods else None

    def raw_score(self, node: NodeState, pod: PodShape) -> float:
        raise NotImplementedError

    def scores_version(self) -> object:
        return 0


class NoArgs(BaseModel):
    """A plug-in that takes no arguments: any given is an error."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def no_defaults(handle: Handle) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class PluginSpec:
    name: str
    kind: Kind
    factory: Callable[[Handle, Any], Any]  # (the framework's handle, its args) -> plug-in
    summary: str  # one line, for the docs table
    args: type[BaseModel] = NoArgs  # its `extender.plugins.args.<name>` section
    # The arguments' defaults from the older top-level keys, read off the handle.
    defaults: Callable[[Handle], dict[str, Any]] = no_defaults


__all__ = [
    "BY_POD",
    "KINDS",
    "MAX_NODE_SCORE",
    "POD",
    "Cycle",
    "CycleState",
    "FilterPlugin",
    "Handle",
    "Kind",
    "MissingStateError",
    "NoArgs",
    "NodeCheck",
    "NodeFilter",
    "NodeScore",
    "PendingPod",
    "PendingView",
    "PluginSpec",
    "PreFilterPlugin",
    "RealPod",
    "ReservePlugin",
    "ScorePlugin",
    "StateKey",
    "TierPlugin",
    "per_node",
]
