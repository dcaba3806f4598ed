"""One rebalancer pass against a fake API (issue 22): dry run only tells, --apply
evicts through the Eviction API, a PDB's 429 is counted and retried, the rate limit
holds, and stale agent data stops everything."""

from __future__ import annotations

import json
from typing import Any

from prometheus_client import CollectorRegistry

from gpudaemon.config import Config
from gpudaemon.errors import KubeUnavailableError
from gpudaemon.rebalancer.app import Rebalancer
from gpudaemon.rebalancer.ratelimit import RateLimit
from gpudaemon.selector import selector_matcher
from tests import kubeobjects
from tests.clock import FakeClock
from tests.unit.extender.test_cluster import lease_obj
from tests.unit.rebalancer.fake_kube import FakeKube

P = "gpudaemon.io/"


def node(name: str, gpus: int = 8, sick: dict[int, list[str]] | None = None) -> dict[str, Any]:
    """`sick`: GPU index -> the pods holding it (the agent's `gpus` annotation)."""
    return kubeobjects.node(
        name, gpus, uid=f"uid-{name}", product="NVIDIA-H100", sick=sick, minimal=True
    )


def pod(name: str, node_name: str = "", gpus: int = 1, owned: bool = True,
        opt_in: bool = True, unschedulable: bool = False) -> dict[str, Any]:  # fmt: skip
    return kubeobjects.pod(
        name, gpus, node_name, uid=f"uid-{name}", namespace="ml", owned=owned, opt_in=opt_in,
        unschedulable=unschedulable, minimal=True,
    )  # fmt: skip


def rig(apply: bool = False, kube: FakeKube | None = None, clock: FakeClock | None = None,
        identity: str = "rb-a", lead: bool = True,
        **rebalance: Any) -> tuple[Rebalancer, FakeKube, FakeClock]:  # fmt: skip
    """A leading rebalancer; pass `kube` and `clock` for another replica of the same
    cluster (or the same one after a restart)."""
    kube, clock = kube or FakeKube(), clock or FakeClock()
    cfg = Config.model_validate(
        {"node_name": "test", "rebalance": {"dry_run": not apply, "grace_s": 60, **rebalance}}
    )
    rb = Rebalancer(cfg, identity, client=kube, registry=CollectorRegistry(),  # type: ignore[arg-type]
                    clock=clock, wall=clock)  # fmt: skip
    assert rb.elector.try_acquire_or_renew() == lead
    return rb, kube, clock


def load(rb: Rebalancer, clock: FakeClock, nodes: list[dict[str, Any]],
         running: list[dict[str, Any]], pending: list[dict[str, Any]] = ()) -> None:  # type: ignore[assignment]  # fmt: skip
    rb.cluster.replace_nodes(nodes)
    rb.cluster.replace_pods(running)
    rb._pending_replace(list(pending))
    rb.cluster.replace_leases(
        [lease_obj(n["metadata"]["name"], clock(), 300, n["metadata"]["uid"]) for n in nodes]
    )


def metric(rb: Rebalancer, name: str, **labels: str) -> float:
    v = rb.registry.get_sample_value(name, labels)
    return 0.0 if v is None else v


def test_dry_run_tells_once_and_evicts_nothing() -> None:
    rb, kube, clock = rig()
    load(rb, clock, [node("n1", sick={3: ["ml/a"]}), node("n2")], [pod("a", "n1")])
    rb.run_pass()
    assert kube.evictions == [] and kube.events == []  # inside the grace period
    clock.advance(61)
    rb.run_pass()
    rb.run_pass()
    assert kube.evictions == []
    assert kube.reasons() == ["RebalanceWouldEvict"]  # once, not every pass
    ev = kube.events[0]
    assert ev["involvedObject"]["name"] == "a" and "GPU 3 on n1" in ev["message"]
    assert ev["reportingInstance"] == "rb-a"
    assert metric(rb, "gpudaemon_rebalancer_evictions_total", kind="drain", result="planned") == 1
    assert metric(rb, "gpudaemon_rebalancer_dry_run") == 1


def test_apply_evicts_and_a_pdb_refusal_is_counted_and_retried() -> None:
    rb, kube, clock = rig(apply=True, grace_s=0)
    load(rb, clock, [node("n1", sick={0: ["ml/a"], 1: ["ml/b"]})],
         [pod("a", "n1"), pod("b", "n1")])  # fmt: skip
    kube.refuse.add("ml/b")
    rb.run_pass()
    assert kube.evictions == [("ml/a", False)]
    assert metric(rb, "gpudaemon_rebalancer_evictions_total", kind="drain", result="done") == 1
    assert metric(rb, "gpudaemon_rebalancer_evictions_total", kind="drain",
                  result="refused_pdb") == 1  # fmt: skip
    assert metric(rb, "gpudaemon_rebalancer_blocked_pods") == 1
    assert "RebalanceEvicted" in kube.reasons() and "RebalanceRefused" in kube.reasons()
    kube.refuse.clear()  # the budget allows it now: the next pass evicts
    rb.cluster.pod_event("MODIFIED", {**pod("a", "n1"), "metadata": {
        **pod("a", "n1")["metadata"], "deletionTimestamp": "2026-11-25T00:00:00Z"}})  # fmt: skip
    rb.run_pass()
    assert kube.evictions == [("ml/a", False), ("ml/b", False)]  # a, going, not again
    assert metric(rb, "gpudaemon_rebalancer_blocked_pods") == 0


def test_bare_pods_get_an_event_and_stale_nodes_nothing() -> None:
    rb, kube, clock = rig(apply=True, grace_s=0)
    load(rb, clock, [node("n1", sick={0: ["ml/bare"]})], [pod("bare", "n1", owned=False)])
    rb.run_pass()
    assert kube.evictions == [] and kube.reasons() == ["RebalanceSkipped"]
    assert "bare pod" in kube.events[0]["message"]
    assert metric(rb, "gpudaemon_rebalancer_skipped_total", kind="drain", reason="bare_pod") == 1
    rb2, kube2, clock2 = rig(apply=True, grace_s=0)
    load(rb2, clock2, [node("n1", sick={0: ["ml/a"]})], [pod("a", "n1")])
    clock2.advance(301)  # the agent's Lease (300 s) has run out
    rb2.run_pass()
    assert kube2.evictions == []
    assert metric(rb2, "gpudaemon_rebalancer_skipped_total", kind="drain", reason="stale") == 1


def test_the_rate_limit_caps_evictions_per_node_and_minute() -> None:
    rb, kube, clock = rig(apply=True, grace_s=0, max_evictions_per_node=2)
    holders = {i: [f"ml/p{i}"] for i in range(4)}
    load(rb, clock, [node("n1", sick=holders)], [pod(f"p{i}", "n1") for i in range(4)])
    rb.run_pass()
    assert len(kube.evictions) == 2
    assert metric(rb, "gpudaemon_rebalancer_skipped_total", kind="drain",
                  reason="rate_limited") == 2  # fmt: skip
    limits = RateLimit(3, 3, clock)
    for n in ("a", "b", "c"):
        limits.record(n)
    assert not limits.allows("d")
    clock.advance(60)
    assert limits.allows("d", 3) and not limits.allows("d", 4)


def test_defragment_evicts_one_nodes_pods_and_only_when_it_holds() -> None:
    nodes = [node(f"n{i}") for i in range(1, 5)]
    running = [pod(f"n{i}-p{j}", f"n{i}") for i in range(1, 5) for j in range(6)]
    big = pod("big", gpus=8, unschedulable=True)
    rb, kube, clock = rig(apply=True)
    load(rb, clock, nodes, running, [big])
    rb.run_pass()
    evicted = [k for k, dry in kube.evictions if not dry]
    assert len(evicted) == 6 and len({k.split("-")[0] for k in evicted}) == 1
    assert all(dry for _, dry in kube.evictions[:6])  # each checked by a dry run first
    assert "RebalanceDefragment" in kube.reasons()
    [(name, patch)] = kube.patches  # the room is kept for it, before any eviction
    node_name = evicted[0].split("/")[1].split("-")[0]
    assert name == "big"
    assert patch["metadata"]["annotations"]["gpudaemon.io/reserved-node"] == node_name
    assert float(patch["metadata"]["annotations"]["gpudaemon.io/reserved-until"]) == (clock() + 300)
    assert metric(rb, "gpudaemon_rebalancer_evictions_total", kind="defrag", result="done") == 6
    rb.run_pass()  # the same pending pod: its plan is settling, nothing more
    assert len([k for k, dry in kube.evictions if not dry]) == 6
    # A PDB on one victim: the plan is not started at all.
    rb2, kube2, clock2 = rig(apply=True)
    load(rb2, clock2, nodes, running, [big])
    kube2.refuse.update(f"ml/n{i}-p0" for i in range(1, 5))
    rb2.run_pass()
    assert [k for k, dry in kube2.evictions if not dry] == []
    assert metric(rb2, "gpudaemon_rebalancer_skipped_total", kind="defrag",
                  reason="refused_pdb") == 1  # fmt: skip
    # Three nodes only: nowhere to put six pods. Nothing is evicted, nothing blocked.
    rb3, kube3, clock3 = rig(apply=True)
    load(rb3, clock3, nodes[:3], running[:18], [big])
    rb3.run_pass()
    assert kube3.evictions == [] and kube3.events == []
    assert metric(rb3, "gpudaemon_rebalancer_blocked_pods") == 0


def test_selector_terms() -> None:
    m = selector_matcher("team=ml, tier!=prod,batch,!pinned")
    assert m({"team": "ml", "batch": ""}) and m({"team": "ml", "tier": "dev", "batch": "1"})
    assert not m({"team": "ml", "tier": "prod", "batch": ""})
    assert not m({"team": "ml", "batch": "", "pinned": "1"}) and not m({"team": "ml"})
    assert not selector_matcher("")({"anything": "x"})


def test_a_restart_keeps_the_rate_limit_window_and_a_new_leader_the_grace_clock() -> None:
    """Both live on the leader Lease: a crash-looping rebalancer cannot evict past the
    per-minute cap, and a standby that takes over does not start the grace again."""
    holders = {i: [f"ml/p{i}"] for i in range(4)}
    nodes = [node("n1", sick=holders)]
    running = [pod(f"p{i}", "n1") for i in range(4)]
    rb, kube, clock = rig(apply=True, grace_s=0, max_evictions_per_minute=2)
    load(rb, clock, nodes, running)
    rb.run_pass()
    assert len(kube.evictions) == 2
    # kill -9 and back, same pod name, 5 s later: still inside the minute.
    clock.advance(5)
    rb2, _, _ = rig(apply=True, kube=kube, clock=clock, grace_s=0, max_evictions_per_minute=2)
    load(rb2, clock, nodes, running[2:])
    rb2.run_pass()
    assert len(kube.evictions) == 2
    assert metric(rb2, "gpudaemon_rebalancer_skipped_total", kind="drain",
                  reason="rate_limited") == 2  # fmt: skip
    clock.advance(56)  # the minute since the evictions is over
    rb2.run_pass()
    assert len(kube.evictions) == 4

    # The grace clock: a sees the sick GPU at t0 and dies at t0+30; b takes over when
    # a's Lease runs out and evicts at t0+60, not a whole grace after taking over.
    a, kube, clock = rig(apply=True, grace_s=60)
    load(a, clock, [node("n1", sick={0: ["ml/x"]})], [pod("x", "n1")])
    a.run_pass()
    b, _, _ = rig(apply=True, kube=kube, clock=clock, identity="rb-b", grace_s=60, lead=False)
    clock.advance(30)
    a.run_pass()
    assert a.elector.checkpoint() and kube.evictions == []
    assert not b.elector.try_acquire_or_renew()  # the standby sees a's last renewal
    clock.advance(16)  # a's 15 s Lease has run out
    assert b.elector.try_acquire_or_renew()
    load(b, clock, [node("n1", sick={0: ["ml/x"]})], [pod("x", "n1")])
    b.run_pass()
    assert kube.evictions == []  # t0+46
    clock.advance(15)
    b.run_pass()
    assert kube.evictions == [("ml/x", False)]  # t0+61


def test_a_replica_that_cannot_write_the_lease_evicts_nothing() -> None:
    rb, kube, clock = rig(apply=True, grace_s=0)
    load(rb, clock, [node("n1", sick={0: ["ml/a"]})], [pod("a", "n1")])
    orig = kube.request

    def no_lease_writes(method: str, path: str, body: Any = None, **kw: Any) -> dict[str, Any]:
        if "leases" in path and method == "PUT":
            raise KubeUnavailableError("PUT lease: etcd timeout", 504)
        return orig(method, path, body, **kw)

    kube.request = no_lease_writes  # type: ignore[method-assign]
    rb.run_pass()
    assert kube.evictions == []  # still "leading" by its deadline, but not proven: no
    assert rb.limits.room("n1") == (10, 8)  # and the window holds nothing it did not do


def test_unreadable_state_on_the_lease_is_ignored() -> None:
    _, kube, clock = rig(apply=True, grace_s=0)
    junks = ("{not json", "[1, 2]", json.dumps({"evictions": [[1, 2], "x", [None, "n"]],
                                               "unhealthy_since": {"nouuid": 1, "n/u": "x"}}))  # fmt: skip
    for junk in junks:
        kube.leases["gpudaemon-rebalancer"]["metadata"]["annotations"][
            "gpudaemon.io/rebalancer-state"
        ] = junk
        rb, _, _ = rig(apply=True, kube=kube, clock=clock, grace_s=0)  # a restart reads it
        assert rb.limits.room("n1") == (10, 8) and rb.state.unhealthy_since == {}


def test_state_from_a_clock_running_ahead_holds_for_a_minute_at_most() -> None:
    _, kube, clock = rig(apply=True, grace_s=0)
    ahead = clock() + 3600
    kube.leases["gpudaemon-rebalancer"]["metadata"]["annotations"][
        "gpudaemon.io/rebalancer-state"
    ] = json.dumps({"evictions": [[ahead, "n1"]] * 3, "unhealthy_since": {"n1/GPU-n1-0": ahead}})
    rb, _, _ = rig(apply=True, kube=kube, clock=clock, grace_s=0, max_evictions_per_node=2)
    assert rb.limits.room("n1")[1] < 0  # counted as just now
    assert rb.state.unhealthy_since[("n1", "GPU-n1-0")] <= clock()
    clock.advance(60)
    assert rb.limits.room("n1") == (10, 2)
