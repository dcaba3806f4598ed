"""The rebalancer's test fleet, shared by tests/property/test_defragment.py and
bench/rebalancer: Nodes of N GPUs of one product, pods owned by a ReplicaSet (opted
in or not, pinned to a model or not, pending and unschedulable without a node), a
leading dry-run Rebalancer whose caches hold them, and `exhaustive`, the first
version's defragmentation search: the bench's baseline and the property test's
oracle."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry

from gpudaemon.cluster.policies.base import Policy
from gpudaemon.cluster.scoring import check_node
from gpudaemon.cluster.state import NodeState
from gpudaemon.config import Config
from gpudaemon.rebalancer.app import Rebalancer
from gpudaemon.rebalancer.planner import (
    NodeFacts,
    Placer,
    Plan,
    PodFacts,
    _without,
    may_land,
)
from tests import kubeobjects
from tests.kubeobjects import lease_obj
from tests.unit.rebalancer.fake_kube import FakeKube  # the API calls of a dry-run pass


def exhaustive(
    pending: PodFacts,
    states: Mapping[str, NodeState | None],
    fresh: Mapping[str, bool],
    facts: Mapping[str, NodeFacts],
    running: Mapping[str, Sequence[PodFacts]],
    policy: Policy,
) -> Plan | None:
    """The first version's search, kept as the baseline and as the tests' oracle
    (tests/property/test_defragment.py): every node's plan, each evicted pod placed by
    scoring every node."""
    if pending.shape.gpus <= 0 or pending.shape.mig or pending.cannot_judge:
        return None
    if pending.gang or not pending.unschedulable:
        return None
    if Placer(states, fresh, facts, policy, running).fits_now(pending):
        return None
    best: Plan | None = None
    for node, st in sorted(states.items()):
        if st is None or not fresh.get(node, False) or not may_land(pending, facts.get(node)):
            continue
        if check_node(st, type(pending.shape)(0), fresh=True) is not None:
            continue
        if st.gpus_allocatable - st.gpus_unhealthy < pending.shape.gpus:
            continue
        need = pending.shape.gpus - st.gpus_free
        movable = sorted(
            (p for p in running.get(node, ())
             if p.opted_in and p.owned and not p.cannot_judge and not p.terminating
             and p.priority <= pending.priority and p.shape.gpus > 0 and not p.shape.mig),
            key=lambda p: (-p.shape.gpus, p.key),
        )  # fmt: skip
        victims: list[PodFacts] = []
        for p in movable:
            if sum(v.shape.gpus for v in victims) >= need:
                break
            victims.append(p)
        if sum(v.shape.gpus for v in victims) < need:
            continue
        if not _without(st, victims).can_host(pending.shape):
            continue
        sim = {n: s for n, s in states.items() if s is not None and n != node}
        targets: list[str] | None = []
        for v in victims:
            scored = {
                n: policy.raw_score(s, v.shape)
                for n, s in sim.items()
                if check_node(s, v.shape, fresh=fresh.get(n, False)) is None
                and s.can_host(v.shape)
                and may_land(v, facts.get(n))
            }
            if not scored:
                targets = None
                break
            top = max(scored.values())
            chosen = min(n for n, sc in scored.items() if sc == top)
            sim[chosen] = sim[chosen].with_placed(v.shape)
            assert targets is not None
            targets.append(chosen)
        if targets is None:
            continue
        plan = Plan(pending, node, tuple(victims), tuple(targets))
        if best is None or plan.cost < best.cost:
            best = plan
    return best


def node(i: int, gpus: int = 8, product: str = "NVIDIA-H100-80GB-HBM3") -> dict[str, Any]:
    """A Node `n<i>` with `gpus` GPUs of `product`, all healthy."""
    return kubeobjects.node(f"n{i:05d}", gpus, product=product, uuid_prefix=str(i))


def pod(name: str, node_name: str, gpus: int, opt_in: bool, model: str = "") -> dict[str, Any]:
    """A pod owned by a ReplicaSet, opted in or not, pinned to a GPU model or not;
    without a node, pending and marked unschedulable by the scheduler."""
    return kubeobjects.pod(name, gpus, node_name, owned=True, opt_in=opt_in, model=model,
                           unschedulable=not node_name)  # fmt: skip


def rebalancer(nodes: list[dict[str, Any]], running: list[dict[str, Any]],
               waiting: list[dict[str, Any]], policy: str = "binpack") -> Rebalancer:  # fmt: skip
    """A leading, synced dry-run rebalancer whose caches hold these objects."""
    cfg = Config.model_validate(
        {"node_name": "bench", "rebalance": {"dry_run": True}, "extender": {"policy": policy}}
    )
    rb = Rebalancer(cfg, "bench", client=FakeKube(), registry=CollectorRegistry())  # type: ignore[arg-type]
    rb.cluster.replace_nodes(nodes)
    rb.cluster.replace_pods(running)
    rb._pending_replace(waiting)
    rb.cluster.replace_leases([lease_obj(o["metadata"]["name"], o["metadata"]["uid"])
                               for o in nodes])  # fmt: skip
    assert rb.elector.try_acquire_or_renew()
    return rb


def planner_inputs(rb: Rebalancer, pending: PodFacts) -> tuple[Any, ...]:
    """defragment's arguments for `pending`, from the rebalancer's caches, as a pass
    takes them."""
    nodes, _, running = rb.facts()
    snap = rb.cluster.snapshot(list(nodes))
    by_node: dict[str, list[PodFacts]] = {}
    for p in running.values():
        by_node.setdefault(p.node, []).append(p)
    return (pending, snap.states, snap.fresh, nodes, by_node, rb.policy)
