"""cluster/dra.py and drastate.py: reading DRA objects (tables), garbage counted and
skipped, per-node device counts, and a pod's needs (no opinion where not understood)."""

from __future__ import annotations

from typing import Any

import pytest

from gpudaemon.cluster.dra import (
    BadDraObject,
    Match,
    parse_cel,
    parse_claim,
    parse_slice,
    parse_taint_rule,
    pod_claim_refs,
)
from gpudaemon.cluster.drastate import DraState
from tests.dra_objects import (
    GPU_CEL,
    MIG_CEL,
    claim,
    claim_spec,
    device_class,
    dra_pod,
    gpu_device,
    gpu_uuid,
    mig_device,
    nvidia_slice,
    taint_rule,
    template,
)

G = "gpu.nvidia.com"


@pytest.mark.parametrize(
    ("cel", "want"),
    [
        (GPU_CEL, Match(G, "gpu", None)),
        (MIG_CEL, Match(G, "mig", None)),
        ('device.driver=="gpu.nvidia.com"&&device.attributes["gpu.nvidia.com"].type=="gpu"',
         Match(G, "gpu", None)),
        ("device.attributes['gpu.nvidia.com'].type == 'gpu' && device.driver == 'gpu.nvidia.com'",
         Match(G, "gpu", None)),
        ("(device.driver == 'gpu.nvidia.com')", Match(G, None, None)),
        ("'gpu' == device.attributes['gpu.nvidia.com'].type", Match(None, "gpu", None)),
        ("device.attributes['gpu.nvidia.com'].profile == '1g.10gb'", Match(None, None, "1g.10gb")),
        ("device.driver == 'nic.example.com'", Match("nic.example.com", None, None)),
        # Not understood: other attributes, other operators, disjunctions, other domains.
        ("device.attributes['gpu.nvidia.com'].productName == 'H100'", None),
        ("device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('40Gi')) >= 0", None),
        ("device.driver == 'gpu.nvidia.com' || device.driver == 'x'", None),
        ("device.attributes['other.com'].type == 'gpu'", None),
        ("device.driver == 'a' && device.driver == 'b'", None),
        ("x" * 20_000, None),
        (None, None),
        (42, None),
    ],
)  # fmt: skip
def test_cel(cel: object, want: Match | None) -> None:
    assert parse_cel(cel) == want


def test_slice_as_nvidia_publishes_it() -> None:
    taint = [{"key": "k", "effect": "NoSchedule"}]
    obj = nvidia_slice("n1", devices=[gpu_device("n1", 0), gpu_device("n1", 1, taint),
                                      mig_device("n1", 2, 0)])  # fmt: skip
    s = parse_slice(obj)
    assert s is not None and (s.node, s.pool) == ("n1", "n1")
    d0, d1, m = s.devices
    assert (d0.name, d0.kind, d0.uuid, d0.tainted) == ("gpu-0", "gpu", gpu_uuid("n1", 0), False)
    assert d1.tainted and not d1.no_execute
    assert (m.kind, m.profile, m.gpu_uuid) == ("mig", "1g.10gb", gpu_uuid("n1", 2))


def test_slice_of_another_driver_or_not_node_local_is_not_ours() -> None:
    other = nvidia_slice("n1")
    other["spec"]["driver"] = "nic.example.com"
    assert parse_slice(other) is None
    shared = nvidia_slice("n1")
    del shared["spec"]["nodeName"]
    shared["spec"]["allNodes"] = True
    assert parse_slice(shared) is None


GARBAGE: list[Any] = [
    None, 7, "x", [], {"metadata": "x"}, {"metadata": {}},
    {"metadata": {"name": "s"}, "spec": []},
    {"metadata": {"name": "s"}, "spec": {"driver": G, "nodeName": "n", "pool": {"name": "n"},
                                          "devices": [{}] * 129}},
    {"metadata": {"name": "s"}, "spec": {"driver": G, "nodeName": "n", "pool": {"name": "n"},
                                          "devices": [{"name": "d", "attributes": {"type": 5}}]}},
    {"metadata": {"name": "s"}, "spec": {"driver": G, "nodeName": ["n"], "pool": {"name": "n"}}},
]  # fmt: skip


@pytest.mark.parametrize("obj", GARBAGE)
def test_garbage_slice_is_one_reason(obj: object) -> None:
    with pytest.raises(BadDraObject):
        parse_slice(obj)


@pytest.mark.parametrize(
    ("spec", "error"),
    [
        (claim_spec(0), True),
        (claim_spec(True), True),
        (claim_spec(2000), True),
        ({"devices": {"requests": [{"name": "x"}]}}, True),
        ({"devices": {"requests": [{"name": "x", "firstAvailable": []}]}}, True),
        ({"devices": {"requests": [{}] * 33}}, True),
        (claim_spec(1, allocationMode="Some"), True),
        (claim_spec(2), False),
    ],
)
def test_claim_spec(spec: dict[str, Any], error: bool) -> None:
    obj = claim("c", spec=spec)
    if error:
        with pytest.raises(BadDraObject):
            parse_claim(obj)
    else:
        c = parse_claim(obj)
        assert c.requests[0][0].count == 2 and not c.allocated


def test_claim_allocation_and_reservation() -> None:
    c = parse_claim(claim("c", 2, allocated=("n1", ["gpu-0", "gpu-1"]), reserved_for=["p1"]))
    assert c.allocated and c.results == ((G, "n1", "gpu-0"), (G, "n1", "gpu-1"))
    assert c.reserved_for == ("p1",) and c.key == "default/c"


def test_taint_rule() -> None:
    r = parse_taint_rule(taint_rule("r", "n1", "gpu-3"))
    assert r is not None and r.selects(G, "n1", "gpu-3") and not r.selects(G, "n1", "gpu-4")
    assert parse_taint_rule(taint_rule("r", "n1", "gpu-3", effect="None")) is None
    assert parse_taint_rule(taint_rule("r", "n1", "gpu-3", effect="NoExecute")).no_execute  # type: ignore[union-attr]


def test_pod_claim_refs() -> None:
    pod = dra_pod("p", [("a", "claim:c1"), ("b", "template:t1"), ("c", "template:t2")],
                  statuses={"b": "p-b-xyz"})  # fmt: skip
    assert pod_claim_refs(pod) == (
        ("default/c1", ""),
        ("default/p-b-xyz", "default/t1"),
        ("", "default/t2"),
    )
    assert pod_claim_refs({"spec": {"containers": []}}) == ()
    assert pod_claim_refs({"spec": {"resourceClaims": "x"}}) == ()


# -- the store ---------------------------------------------------------------------------


def store() -> tuple[DraState, list[str]]:
    changed: list[str] = []
    d = DraState(changed.append)
    d.replace_classes([device_class(), device_class("mig.nvidia.com", MIG_CEL)])
    return d, changed


def test_counts_allocated_tainted() -> None:
    d, changed = store()
    d.slice_event("ADDED", nvidia_slice("n1", devices=[
        *(gpu_device("n1", i) for i in range(6)),
        gpu_device("n1", 6, [{"key": "k", "effect": "NoExecute"}]),
        gpu_device("n1", 7, [{"key": "k", "effect": "None"}]),
        mig_device("n1", 8, 0), mig_device("n1", 8, 1),
    ]))  # fmt: skip
    d.claim_event("ADDED", claim("c", 2, allocated=("n1", ["gpu-0", "gpu-1"])))
    d.claim_event("ADDED", claim("m", 1, cls="mig.nvidia.com",
                                 allocated=("n1", ["gpu-8-mig-1g-10gb-0"])))  # fmt: skip
    d.rule_event("ADDED", taint_rule("r", "n1", "gpu-5"))
    d.rule_event("ADDED", taint_rule("r2", "n1", "gpu-0"))  # allocated: not counted as free
    c = d.counts("n1")
    assert c is not None
    assert (c.gpus, c.gpus_allocated) == (8, 2)
    assert sorted(c.tainted_free) == sorted([gpu_uuid("n1", 5), gpu_uuid("n1", 6)])
    assert c.mig == (("1g.10gb", 2),) and c.mig_allocated == (("1g.10gb", 1),)
    assert "n1" in changed
    d.rule_event("DELETED", taint_rule("r", "n1", "gpu-5"))
    assert len(d.counts("n1").tainted_free) == 1  # type: ignore[union-attr]
    d.claim_event("DELETED", claim("c"))
    assert d.counts("n1").gpus_allocated == 0  # type: ignore[union-attr]
    assert d.counts("nope") is None


def test_garbage_is_counted_not_raised() -> None:
    d, _ = store()
    for g in GARBAGE:
        d.slice_event("ADDED", g)
        d.claim_event("ADDED", g)
        d.class_event("ADDED", g)
        d.template_event("ADDED", g)
        d.rule_event("ADDED", g)
    assert d.bad["resourceslices"] == len(GARBAGE)
    # The last is a claim with no requests (no spec.devices): readable, and needs nothing.
    assert d.bad["resourceclaims"] == len(GARBAGE) - 1
    assert d.slices == {} and [c.requests for c in d.claims.values()] == [()]


def test_a_slice_replaced_by_garbage_is_dropped() -> None:
    d, _ = store()
    d.slice_event("ADDED", nvidia_slice("n1"))
    bad = nvidia_slice("n1")
    bad["spec"]["devices"] = "x"
    d.slice_event("MODIFIED", bad)
    assert d.counts("n1") is None


def refs(*pairs: tuple[str, str]) -> tuple[tuple[str, str], ...]:
    return pairs


@pytest.mark.parametrize(
    ("claim_obj", "gpus", "mig", "reason"),
    [
        (claim("c", 4), 4, (), ""),
        (claim("c", 2, cls="mig.nvidia.com"), 0, (), "mig_any_profile"),
        (claim("c", 1, spec={"devices": {"requests": [{"name": "r", "exactly": {
            "deviceClassName": "mig.nvidia.com", "count": 3, "selectors": [{"cel": {
                "expression": "device.attributes['gpu.nvidia.com'].profile == '1g.10gb'"}}]}}]}}),
         0, (("1g.10gb", 3),), ""),
        (claim("c", 1, cls="nope"), 0, (), "unknown_class"),
        (claim("c", 1, cls="nic"), 0, (), "other_driver"),
        (claim("c", 1, cls="weird"), 0, (), "cel"),
        (claim("c", spec=claim_spec(1, adminAccess=True)), 0, (), "admin_access"),
        (claim("c", spec={"devices": {"requests": [{"name": "r", "exactly": {
            "deviceClassName": "gpu.nvidia.com", "allocationMode": "All"}}]}}), 0, (), "all_devices"),
        (claim("c", spec=claim_spec(1, tolerations=[{"operator": "Exists"}])), 0, (), "tolerations"),
        (claim("c", spec=claim_spec(1, selectors=[{"cel": {"expression":
            "device.attributes['gpu.nvidia.com'].productName == 'H100'"}}])), 0, (), "cel"),
        (claim("c", spec={"devices": {"requests": [{"name": "r", "firstAvailable": [
            {"name": "a", "deviceClassName": "gpu.nvidia.com", "count": 4},
            {"name": "b", "deviceClassName": "gpu.nvidia.com", "count": 2}]}]}}), 2, (), ""),
        (claim("c", spec={"devices": {"requests": [{"name": "r", "firstAvailable": [
            {"name": "a", "deviceClassName": "gpu.nvidia.com", "count": 1},
            {"name": "b", "deviceClassName": "mig.nvidia.com", "count": 2, "selectors": [{"cel": {
                "expression": "device.attributes['gpu.nvidia.com'].profile == '1g.10gb'"}}]}]}]}}),
         0, (), "first_available"),
        (claim("c", 2, allocated=("n1", ["gpu-0", "gpu-1"])), 0, (), ""),  # allocated: nothing
    ],
)  # fmt: skip
def test_needs(claim_obj: dict[str, Any], gpus: int, mig: Any, reason: str) -> None:
    d, _ = store()
    d.class_event("ADDED", device_class("nic", "device.driver == 'nic.example.com'"))
    d.class_event("ADDED", device_class("weird", "device.attributes['x'].y > 3"))
    d.claim_event("ADDED", claim_obj)
    n = d.needs(refs(("default/c", "")))
    assert (n.gpus, n.mig) == (gpus, mig)
    if reason:
        assert d.not_understood == {reason: 1}
        d.needs(refs(("default/c", "")))
        assert d.not_understood == {reason: 1}  # once per claim, not per request
    else:
        assert d.not_understood == {}


def test_needs_from_template_until_the_claim_exists() -> None:
    d, _ = store()
    d.template_event("ADDED", template("t", 2))
    assert d.needs(refs(("", "default/t"))).gpus == 2
    assert d.needs(refs(("default/p-gpu-x", "default/t"))).gpus == 2
    d.claim_event("ADDED", claim("p-gpu-x", 2, allocated=("n1", ["gpu-0", "gpu-1"])))
    assert d.needs(refs(("default/p-gpu-x", "default/t"))).gpus == 0
    n = d.needs(refs(("default/missing", "")))
    assert n.reason == "missing" and n.gpus == 0


def test_needs_sum_over_claims() -> None:
    d, _ = store()
    d.claim_event("ADDED", claim("a", 2))
    d.claim_event("ADDED", claim("b", 1))
    n = d.needs(refs(("default/a", ""), ("default/b", "")))
    assert n.gpus == 3 and [p[:2] for p in n.parts] == [("default/a", 2), ("default/b", 1)]


def test_a_gpu_with_a_mig_device_allocated_is_no_free_gpu_and_the_reverse() -> None:
    # A driver that publishes a GPU beside the MIG devices carved from it (dynamic MIG):
    # allocating either side takes the other.
    d, _ = store()
    d.slice_event("ADDED", nvidia_slice("n1", devices=[
        gpu_device("n1", 0), mig_device("n1", 0, 0), mig_device("n1", 0, 1),
        gpu_device("n1", 1), mig_device("n1", 1, 0), mig_device("n1", 1, 1),
    ]))  # fmt: skip
    d.claim_event("ADDED", claim("m", 1, cls="mig.nvidia.com",
                                 allocated=("n1", ["gpu-0-mig-1g-10gb-0"])))  # fmt: skip
    d.claim_event("ADDED", claim("g", 1, allocated=("n1", ["gpu-1"])))
    c = d.counts("n1")
    assert c is not None
    assert (c.gpus, c.gpus_allocated) == (2, 2)  # gpu-0 is partly used: not free
    # gpu-0's other MIG device stays free; both of gpu-1's are taken with it.
    assert c.mig == (("1g.10gb", 4),) and c.mig_allocated == (("1g.10gb", 3),)


def test_a_slice_for_another_nodes_pool_is_refused_and_changes_nothing_there() -> None:
    """A compromised node publishing a slice under another node's pool would make that
    pool's allocations and taint rules count on the wrong node (and its deletion would
    orphan the real one): NVIDIA names each pool after its node, so anything else is
    refused and counted."""
    d, _ = store()
    d.slice_event("ADDED", nvidia_slice("n1"))
    d.claim_event("ADDED", claim("c", 2, allocated=("n1", ["gpu-0", "gpu-1"])))
    forged = nvidia_slice("evil", name="evil-slice")
    forged["spec"]["pool"]["name"] = "n1"
    d.slice_event("ADDED", forged)
    d.slice_event("DELETED", forged)
    assert d.bad == {"resourceslices": 1}
    assert d.counts("evil") is None
    d.claim_event("ADDED", claim("c2", 1, allocated=("n1", ["gpu-2"])))
    c = d.counts("n1")
    assert c is not None and (c.gpus, c.gpus_allocated) == (8, 3)


def test_a_taint_rule_recounts_only_its_pools_node_and_a_poolless_one_all() -> None:
    """An agent may write any number of rules for its own pool: each must cost its own
    node's recount, not every node's."""
    d, changed = store()
    for n in ("n1", "n2", "n3"):
        d.slice_event("ADDED", nvidia_slice(n))
    changed.clear()
    for i in range(50):
        d.rule_event("ADDED", taint_rule(f"r{i}", "n1", f"gpu-{i % 8}"))
    assert set(changed) == {"n1"}
    assert len(d.counts("n1").tainted_free) == 8  # type: ignore[union-attr]
    assert d.counts("n2").tainted_free == ()  # type: ignore[union-attr]
    changed.clear()
    everywhere = taint_rule("all", "x", "gpu-0")
    del everywhere["spec"]["deviceSelector"]["pool"]
    d.rule_event("ADDED", everywhere)
    assert set(changed) == {"n1", "n2", "n3"}
    assert len(d.counts("n3").tainted_free) == 1  # type: ignore[union-attr]
    changed.clear()
    d.rule_event("DELETED", taint_rule("r0", "n1", "gpu-0"))
    assert set(changed) == {"n1"}
