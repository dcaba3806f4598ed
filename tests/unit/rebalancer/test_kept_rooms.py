"""The `reserved` plug-in in the rebalancer: a victim is never planned into the room
the rebalancer itself keeps for another pending pod (its own reservations, the ones it
writes to its Lease, never the pods' annotations), unless the victim is the pod the
room is for, or of higher priority than it, as the extender would judge it."""

from __future__ import annotations

from gpudaemon.cluster.clusterstate import ClusterState
from gpudaemon.cluster.plugins import Profile, build_profile
from gpudaemon.cluster.policies import build_policies
from gpudaemon.cluster.reservations import RESERVED_NODE_ANNOTATION, Reservation
from gpudaemon.config import ExtenderConfig, PluginsConfig
from gpudaemon.rebalancer.planner import PlacementHandle, Placer, PodFacts, defragment
from gpudaemon.rebalancer.ratelimit import RateLimit
from gpudaemon.rebalancer.state import LeaseState
from tests.clock import FakeClock
from tests.unit.rebalancer.test_planner import BINPACK, facts, fresh, pod
from tests.unit.rebalancer.test_pod_policy import NODES, rig, running_objs
from tests.unit.rebalancer.test_profile import three_nodes
from tests.unit.rebalancer.test_rebalancer import load
from tests.unit.rebalancer.test_rebalancer import pod as pod_obj

POLICIES = build_policies(ExtenderConfig())
NOW = 1000.0


class Pending:
    """Pending pods by UID (the plug-ins' `PendingView`)."""

    def __init__(self, *pods: PodFacts) -> None:
        self.pods = {p.uid: p for p in pods}

    def get(self, uid: str) -> PodFacts | None:
        return self.pods.get(uid)

    def gang_members(self, gang: str) -> list[PodFacts]:
        return [p for p in self.pods.values() if p.gang == gang]


def keeping(node: str, *pending: PodFacts) -> tuple[Profile, LeaseState]:
    """The default profile, as the rebalancer builds it, keeping room on `node` for
    each of `pending` (in its own state, as `Pass.reserve` keeps it)."""
    clock = FakeClock(NOW)
    state = LeaseState(RateLimit(10, 10, clock), clock)
    for p in pending:
        state.reserve(Reservation(p.uid, p.key, node, p.shape.gpus, p.priority, 0.0),
                      {p.uid}, 300, 16)  # fmt: skip
    handle = PlacementHandle(ClusterState(), POLICIES, pending=Pending(*pending),
                             reservations=state)  # fmt: skip
    return build_profile(PluginsConfig(), handle), state


def plan_for(
    running: dict[str, list[PodFacts]], prof: Profile
) -> tuple[str, tuple[str, ...]] | None:
    states, _ = three_nodes()
    ok, f = fresh(states), facts(states)
    placer = Placer(states, ok, f, BINPACK, running, profile=prof, now=NOW)
    plan = defragment(pod("big", gpus=8), states, ok, f, running, BINPACK, placer)
    return None if plan is None else (plan.node, plan.targets)


def test_a_victim_is_not_placed_where_the_free_gpus_are_kept_for_another_pod() -> None:
    """n1's 4-GPU pod goes to n2 by binpack, unless n2's 4 free GPUs are kept for
    another pending 4-GPU pod: then to n3, where the extender would place it."""
    _, running = three_nodes()
    free, _ = keeping("n3")
    assert plan_for(running, free) == ("n1", ("n2",))
    kept, _ = keeping("n2", pod("other", gpus=4))
    assert plan_for(running, kept) == ("n1", ("n3",))


def test_the_pod_a_room_is_kept_for_may_take_it() -> None:
    _, running = three_nodes()
    victim = running["n1"][0]
    prof, _ = keeping("n2", victim)
    assert plan_for(running, prof) == ("n1", ("n2",))


def test_a_room_kept_for_a_pod_of_lower_priority_does_not_bar_a_victim() -> None:
    _, running = three_nodes()
    prof, _ = keeping("n2", pod("other", gpus=4, priority=-1))
    assert plan_for(running, prof) == ("n1", ("n2",))


def test_a_room_that_ran_out_keeps_nothing() -> None:
    _, running = three_nodes()
    prof, state = keeping("n2", pod("other", gpus=4))
    states, _ = three_nodes()
    later = NOW + 301  # past the 300 s it was kept for
    placer = Placer(states, fresh(states), facts(states), BINPACK, running, profile=prof,
                    now=later)  # fmt: skip
    plan = defragment(pod("big", gpus=8), states, fresh(states), facts(states), running,
                      BINPACK, placer)  # fmt: skip
    assert plan is not None and plan.targets == ("n2",)
    assert state.in_force(later) == {}


def test_no_room_is_made_for_a_pod_where_the_room_is_kept_for_another() -> None:
    """n2 and n3 alone. Emptied of its two pods, n3 would hold the 8-GPU pod; with 4
    of its GPUs kept for `other` (of no lower priority) the extender would not place it
    there, and n2's four pods cannot all go to n3's 2 GPUs left: no plan."""
    states, running = three_nodes()
    del states["n1"], running["n1"]
    ok, f = fresh(states), facts(states)
    for prof, expected in ((keeping("n1")[0], ("n3", ("n2", "n2"))),
                           (keeping("n3", pod("other", gpus=4))[0], None)):  # fmt: skip
        placer = Placer(states, ok, f, BINPACK, running, profile=prof, now=NOW)
        plan = defragment(pod("big", gpus=8), states, ok, f, running, BINPACK, placer)
        assert (None if plan is None else (plan.node, plan.targets)) == expected


# -- end to end -----------------------------------------------------------------------


def test_the_rebalancer_keeps_its_victims_out_of_the_room_it_keeps() -> None:
    """A room on n2 is kept for `other` (4 GPUs), in the rebalancer's own state: the
    victim of the plan for `big` goes to n3. A pod's own reserved-node annotation,
    which anyone may write, keeps nothing."""
    rb, kube, clock = rig()
    other = pod_obj("other", gpus=4, unschedulable=True)
    big = pod_obj("big", gpus=8, unschedulable=True)
    load(rb, clock, NODES, running_objs(None), [big, other])
    assert rb.passes.reserve(rb.pending["uid-other"], "n2")
    rb.run_pass()
    [told] = [e["message"] for e in kube.events if e["reason"] == "RebalanceDefragment"]
    assert "room on n1" in told and "fits now on: n3" in told

    rb, kube, clock = rig()
    other["metadata"].setdefault("annotations", {})[RESERVED_NODE_ANNOTATION] = "n2"
    load(rb, clock, NODES, running_objs(None), [big, other])
    rb.run_pass()
    [told] = [e["message"] for e in kube.events if e["reason"] == "RebalanceDefragment"]
    assert "room on n1" in told and "fits now on: n2" in told
