"""The rebalancer's half of a GPU reset (rebalancer/resets.py): a reset_gpu GPU whose
pods are gone gets a grant on its Node; the fleet's concurrency limit, one per node,
the circuit breaker and the maintenance window hold grants back (each test fails when
its check is removed); dry run writes none; a grant nobody answered is removed. And
with remediation on, reboot_node takes the node's other GPU pods only once the node is
cordoned."""

from __future__ import annotations

import json
from typing import Any

from prometheus_client import CollectorRegistry

from gpudaemon.config import Config
from gpudaemon.rebalancer.app import Rebalancer
from gpudaemon.remediation.grant import parse
from tests.clock import FakeClock
from tests.unit.rebalancer.fake_kube import FakeKube
from tests.unit.rebalancer.test_drain_actions import verdict_node
from tests.unit.rebalancer.test_rebalancer import P, load, metric, node, pod

KEY = P + "gpu-reset"


def rig(apply: bool = True, **remediation: Any) -> tuple[Rebalancer, FakeKube, FakeClock]:
    kube, clock = FakeKube(), FakeClock()
    cfg = Config.model_validate({
        "node_name": "test",
        "rebalance": {"dry_run": not apply, "grace_s": 60},
        "remediation": {"reset_gpu": True, "drain_grace_s": 5, **remediation},
    })  # fmt: skip
    rb = Rebalancer(cfg, "rb-a", client=kube, registry=CollectorRegistry(),  # type: ignore[arg-type]
                    clock=clock, wall=clock)  # fmt: skip
    assert rb.elector.try_acquire_or_renew()
    return rb, kube, clock


def node_event(rb: Rebalancer, kind: str, obj: dict[str, Any]) -> None:
    """As the Node watch hands it to every handler of the rebalancer's Node informer."""
    [r] = [r for r in rb.reflectors if r.kind == "nodes"]
    r.on_event(kind, obj)


def grants(kube: FakeKube) -> dict[str, dict[str, Any]]:
    """Node -> the grant the rebalancer wrote there (merge patches only)."""
    out = {}
    for name, body in kube.patches:
        ann = (body.get("metadata") or {}).get("annotations") if isinstance(body, dict) else None
        if ann and KEY in ann:
            out[name] = json.loads(ann[KEY])
    return out


def sick_nodes(n: int, holders: bool = False, gpus: int = 8) -> list[dict[str, Any]]:
    """n nodes whose GPU 0 needs a reset (held by ml/p<node> with `holders`)."""
    out = []
    for i in range(n):
        first = ("unhealthy", "reset_gpu", [f"ml/p{i}"] if holders else [])
        out.append(verdict_node(f"n{i}", [first] + [("healthy", "none", [])] * (gpus - 1)))
    return out


def test_a_drained_gpu_is_granted_its_reset_after_the_short_grace() -> None:
    rb, kube, clock = rig(max_unhealthy_fraction=1.0)
    load(rb, clock, sick_nodes(1, holders=True), [pod("p0", "n0")])
    rb.run_pass()
    assert kube.evictions == [] and grants(kube) == {}
    clock.advance(6)  # remediation.drain_grace_s, not rebalance.grace_s (60)
    rb.run_pass()
    assert kube.evictions == [("ml/p0", False)]
    assert grants(kube) == {}  # its pod still holds it (terminating, or not gone yet)
    rb.cluster.replace_pods([])  # the pod is gone
    rb.run_drain_pass()
    [(where, g)] = grants(kube).items()
    assert where == "n0" and g["uuid"] == "GPU-n0-0" and g["index"] == 0
    assert g["until"] - g["granted_at"] == 300
    assert metric(rb, "gpudaemon_rebalancer_resets_total", result="granted") == 1


def test_at_most_max_concurrent_across_the_fleet_and_one_per_node() -> None:
    rb, kube, clock = rig(max_concurrent=2, max_unhealthy_fraction=1.0)
    nodes = sick_nodes(3)
    two = verdict_node("m", [("unhealthy", "reset_gpu", [])] * 2 + [("healthy", "none", [])] * 6)
    load(rb, clock, [*nodes, two], [])
    rb.run_pass()  # the grace clocks start
    clock.advance(6)
    rb.run_pass()
    assert len(grants(kube)) == 2
    for name, g in grants(kube).items():  # as the Node watch then shows them
        obj = next(n for n in [*nodes, two] if n["metadata"]["name"] == name)
        obj["metadata"]["annotations"][KEY] = json.dumps(g)
        node_event(rb, "MODIFIED", obj)
    rb.run_drain_pass()
    assert len(grants(kube)) == 2  # no third while two are out
    assert metric(rb, "gpudaemon_rebalancer_resets_total", result="concurrency") >= 1


def test_one_reset_per_node_even_with_room_in_the_fleet() -> None:
    rb, kube, clock = rig(max_concurrent=5, max_unhealthy_fraction=1.0)
    two = verdict_node("m", [("unhealthy", "reset_gpu", [])] * 2 + [("healthy", "none", [])] * 6)
    load(rb, clock, [two], [])
    rb.run_pass()  # the grace clocks start
    clock.advance(6)
    rb.run_pass()
    assert list(grants(kube)) == ["m"] and len(kube.patches) == 1


def test_the_circuit_breaker_holds_resets_back_during_a_fleet_wide_event() -> None:
    rb, kube, clock = rig(max_unhealthy_fraction=0.1, window_s=30)  # 2 of 16 GPUs: 12.5 %
    load(rb, clock, sick_nodes(2), [])
    rb.run_pass()  # the grace clocks start
    clock.advance(6)
    rb.run_pass()
    assert grants(kube) == {}
    assert rb.registry.get_sample_value("gpudaemon_rebalancer_reset_breaker_open") == 1
    assert metric(rb, "gpudaemon_rebalancer_resets_total", result="breaker_open") == 2
    clock.advance(31)  # remediation.window_s: they are no longer "just turned"
    rb.run_drain_pass()
    assert len(grants(kube)) == 2


def test_outside_the_maintenance_window_no_reset_starts() -> None:
    rb, kube, clock = rig(maintenance_window="00:00-00:01", max_unhealthy_fraction=1.0)
    clock.t = 86400 * 20000 + 3600  # 01:00 UTC
    load(rb, clock, sick_nodes(1), [])
    rb.run_pass()  # the grace clocks start
    clock.advance(6)
    rb.run_pass()
    assert grants(kube) == {}
    assert metric(rb, "gpudaemon_rebalancer_resets_total", result="window_closed") == 1


def test_dry_run_grants_nothing() -> None:
    rb, kube, clock = rig(apply=False, max_unhealthy_fraction=1.0)
    load(rb, clock, sick_nodes(1), [])
    rb.run_pass()  # the grace clocks start
    clock.advance(6)
    rb.run_pass()
    assert (
        kube.patches == []
        and metric(rb, "gpudaemon_rebalancer_resets_total", result="planned") == 1
    )


def test_a_grant_nobody_answered_is_removed_when_it_runs_out() -> None:
    rb, kube, clock = rig(max_unhealthy_fraction=1.0, grant_ttl_s=60)
    nodes = sick_nodes(1)
    load(rb, clock, nodes, [])
    rb.run_pass()  # the grace clocks start
    clock.advance(6)
    rb.run_pass()
    g = grants(kube)["n0"]
    nodes[0]["metadata"]["annotations"][KEY] = json.dumps(g)
    node_event(rb, "MODIFIED", nodes[0])
    assert parse(json.dumps(g), KEY).uuid == "GPU-n0-0"
    clock.advance(61)
    rb.run_drain_pass()
    removal = [b for _, b in kube.patches if isinstance(b, list)]
    assert removal and removal[0][1] == {
        "op": "remove",
        "path": "/metadata/annotations/gpudaemon.io~1gpu-reset",
    }
    assert metric(rb, "gpudaemon_rebalancer_resets_total", result="expired") == 1


def test_reboot_node_drains_the_other_gpus_only_once_the_node_is_cordoned() -> None:
    rb, kube, clock = rig(max_unhealthy_fraction=1.0)
    rows = [("unhealthy", "reboot_node", ["ml/lost"]), ("healthy", "none", ["ml/other"])]
    n1 = verdict_node("n1", rows)
    load(rb, clock, [n1, node("n2")], [pod("lost", "n1"), pod("other", "n1")])
    rb.run_pass()
    clock.advance(61)
    rb.run_pass()
    assert kube.evictions == [("ml/lost", False)]  # the GPU's own holder only
    n1["spec"] = {"unschedulable": True}  # whatever reboots it has taken it
    rb.cluster.node_event("MODIFIED", n1)
    rb.run_drain_pass()
    assert sorted(kube.evictions) == [("ml/lost", False), ("ml/other", False)]
    assert grants(kube) == {}  # never a reset for reboot_node
