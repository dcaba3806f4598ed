"""The agent's DRA half, node side: reading this node's ResourceSlices as NVIDIA's driver
publishes them (hostile entries skipped), rule names, and the DeviceTaintRule reconcile
(create for an unhealthy GPU and its MIG devices, remove when healthy, garbage at start,
backoff with one line per outage, nothing written without slices), against a fake
client that keeps objects as the API server would."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import pytest

from gpudaemon.agent.devicetaints import DeviceTaints, rule_body, rule_name
from gpudaemon.agent.resourceslices import DRIVER, DraDevice, SliceIndex, parse_slices
from gpudaemon.errors import KubeNotFoundError, KubeUnavailableError
from gpudaemon.model import PodRef
from gpudaemon.podresources.client import DRA_RESOURCE, _dra_assignments

NODE = "gpu-0"
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def dev(name: str, uuid: str, kind: str = "gpu", parent: str = "") -> dict[str, Any]:
    attrs: dict[str, Any] = {"type": {"string": kind}, "uuid": {"string": uuid}}
    if parent:
        attrs["parentUUID"] = {"string": parent}
    return {"name": name, "attributes": attrs, "capacity": {"memory": {"value": "80Gi"}}}


def slice_(devices: list[Any], node: str = NODE, gen: int = 1, driver: str = DRIVER) -> Any:
    return {
        "metadata": {"name": f"{node}-{driver}-{gen}"},
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": node, "generation": gen, "resourceSliceCount": 1},
            "devices": devices,
        },
    }


class FakeApi:
    """Slices and rules as the API server keeps them; `down` fails every call."""

    def __init__(self, slices: list[Any]) -> None:
        self.slices = slices
        self.rules: dict[str, dict[str, Any]] = {}
        self.calls: list[str] = []
        self.down = False

    def _check(self, what: str) -> None:
        self.calls.append(what)
        if self.down:
            raise KubeUnavailableError(f"{what}: connection refused")

    def list_items(
        self, path: str, query: Mapping[str, str] | None = None, page_size: int = 500
    ) -> tuple[list[dict[str, Any]], str]:
        self._check(f"LIST {path.rsplit('/', 1)[-1]}")
        if path.endswith("resourceslices"):
            return list(self.slices), "1"
        sel = dict(kv.split("=", 1) for kv in (query or {})["labelSelector"].split(","))
        return [
            r for r in self.rules.values()
            if all(r["metadata"]["labels"].get(k) == v for k, v in sel.items())
        ], "1"  # fmt: skip

    def apply(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        self._check(f"APPLY {path.rsplit('/', 1)[-1]}")
        self.rules[body["metadata"]["name"]] = dict(body)
        return dict(body)

    def request(self, method: str, path: str) -> dict[str, Any]:
        name = path.rsplit("/", 1)[-1]
        self._check(f"{method} {name}")
        if name not in self.rules:
            raise KubeNotFoundError(f"{method} {path}: HTTP 404", 404)
        return dict(self.rules[name]) if method == "GET" else self.rules.pop(name)

    def close(self) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


H100 = [dev(f"gpu-{i}", f"GPU-{i:04d}") for i in range(8)]


def make(api: FakeApi, clock: Clock, effect: str = "NoSchedule") -> DeviceTaints:
    slices = SliceIndex(api, NODE, reread_after_s=30, clock=clock)
    return DeviceTaints(
        api, NODE, slices, prefix="gpudaemon.io/", effect=effect, clock=clock, rng=lambda: 1.0
    )


def selectors(api: FakeApi) -> list[tuple[str, str, str, str, str]]:
    out = []
    for r in api.rules.values():
        sel, taint = r["spec"]["deviceSelector"], r["spec"]["taint"]
        out.append((sel["driver"], sel["pool"], sel["device"], taint["key"], taint["effect"]))
    return sorted(out)


def test_an_unhealthy_gpu_gets_one_rule_for_exactly_its_device_and_loses_it_when_healthy() -> None:
    api, clock = FakeApi([slice_(H100)]), Clock()
    t = make(api, clock)
    assert t.sync({}) is False
    assert api.calls == ["LIST devicetaintrules"]  # garbage check only: slices not read
    assert t.sync({"GPU-0003": "xid 79"}) is True
    assert selectors(api) == [(DRIVER, NODE, "gpu-3", "gpudaemon.io/unhealthy", "NoSchedule")]
    rule = next(iter(api.rules.values()))
    assert rule["spec"]["taint"]["value"] == "xid-79"
    assert rule["metadata"]["labels"] == {
        "app.kubernetes.io/name": "gpudaemon",
        "app.kubernetes.io/component": "device-taint",
        "gpudaemon.io/node": NODE,
    }
    n = len(api.calls)
    assert t.sync({"GPU-0003": "xid 79"}) is False  # unchanged: no call at all
    assert len(api.calls) == n
    assert t.sync({}) is True  # repaired
    assert api.rules == {}


def test_a_mig_gpu_takes_its_mig_devices_with_it() -> None:
    devices = [
        dev("gpu-0", "GPU-0000"),
        dev("gpu-0-mig-9-0-1", "MIG-a", "mig", "GPU-0000"),
        dev("gpu-0-mig-9-1-1", "MIG-b", "mig", "GPU-0000"),
        dev("gpu-1", "GPU-0001"),
    ]
    api, clock = FakeApi([slice_(devices)]), Clock()
    make(api, clock).sync({"GPU-0000": "uncorrectable ecc"})
    assert [s[2] for s in selectors(api)] == ["gpu-0", "gpu-0-mig-9-0-1", "gpu-0-mig-9-1-1"]


def test_stale_rules_of_this_node_are_removed_at_start_and_others_kept() -> None:
    api, clock = FakeApi([slice_(H100)]), Clock()
    make(api, clock).sync({"GPU-0001": "xid 79", "GPU-0002": "xid 48"})
    other = FakeApi([slice_(H100, node="gpu-1")])
    make(other, clock).sync({})
    api.rules["someone-elses"] = {"metadata": {"name": "someone-elses", "labels": {}}}
    # A restarted agent: GPU 1 was repaired meanwhile.
    make(api, clock).sync({"GPU-0002": "xid 48"})
    assert sorted(api.rules) == sorted(["someone-elses", rule_name(NODE, "gpu-2")])


def test_effect_none_and_a_changed_effect_rewrites_the_rule() -> None:
    api, clock = FakeApi([slice_(H100)]), Clock()
    make(api, clock, effect="None").sync({"GPU-0000": "xid 79"})
    assert selectors(api)[0][4] == "None"
    make(api, clock).sync({"GPU-0000": "xid 79"})
    assert selectors(api)[0][4] == "NoSchedule"
    with pytest.raises(ValueError, match="NoExecute"):
        make(api, clock, effect="NoExecute")


def test_api_errors_back_off_log_one_line_per_outage_and_never_raise() -> None:
    from loguru import logger

    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(str(m)), level="INFO")
    try:
        api, clock = FakeApi([slice_(H100)]), Clock()
        t = make(api, clock)
        api.down = True
        for _ in range(5):
            assert t.sync({"GPU-0004": "xid 79"}) is False
            clock.t += 0.2
        attempts = len(api.calls)
        assert attempts < 5  # the backoff held the others back
        api.down = False
        clock.t += 120
        assert t.retry() is True
        assert [s[2] for s in selectors(api)] == ["gpu-4"]
    finally:
        logger.remove(sink)
    assert sum("DeviceTaintRules not written" in x for x in lines) == 1
    assert sum("written after" in x for x in lines) == 1


def test_no_slice_on_the_node_says_so_once_and_writes_nothing() -> None:
    from loguru import logger

    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(str(m)), level="INFO")
    try:
        api, clock = FakeApi([slice_(H100, node="elsewhere")]), Clock()
        t = make(api, clock)
        for _ in range(4):
            t.sync({"GPU-0000": "xid 79"})
            clock.t += 40  # past the re-read period: read again, quietly
            t.retry()
    finally:
        logger.remove(sink)
    assert api.rules == {}
    assert not any(c.startswith(("APPLY", "DELETE")) for c in api.calls)
    assert sum("is NVIDIA's DRA driver installed" in x for x in lines) == 1
    assert not any("is not in" in x for x in lines)


def test_a_gpu_the_driver_publishes_later_is_tainted_once_the_slice_has_it() -> None:
    api, clock = FakeApi([slice_(H100[:4])]), Clock()
    t = make(api, clock)
    t.sync({"GPU-0006": "xid 79"})
    assert api.rules == {}
    api.slices = [slice_(H100)]
    clock.t += 10
    t.retry()  # within the re-read period: not read again
    assert api.rules == {}
    clock.t += 30
    assert t.retry() is True
    assert [s[2] for s in selectors(api)] == ["gpu-6"]


@pytest.mark.parametrize(
    "node,device",
    [
        ("gpu-0", "gpu-0"),
        ("node.example.com", "gpu-7-mig-9-0-1"),
        ("a" * 253, "gpu-1"),
        ("a-b", "c"),
        ("a", "b-c"),
        ("x." + "y" * 200 + ".z", "gpu-0-mig-14-3-4"),
    ],
)
def test_rule_names_are_bounded_dns_subdomains_unique_per_node_and_device(
    node: str, device: str
) -> None:
    name = rule_name(node, device)
    assert len(name) <= 253 and DNS_SUBDOMAIN.match(name), name
    assert name == rule_name(node, device)
    assert rule_name("a-b", "c") != rule_name("a", "b-c")


def test_hostile_slices_are_skipped_and_counted() -> None:
    good = dev("gpu-0", "GPU-0000")
    bad = [
        "not a device",
        {"name": "UPPER", "attributes": {"uuid": {"string": "GPU-x"}}},
        {"name": "gpu-1", "attributes": {"uuid": {"int": 3}}},
        {"name": "gpu-2", "attributes": {"uuid": {"string": "x" * 500}}},
        {"name": "gpu-3"},
        dev("gpu-4", "GPU-bad uuid with spaces"),
    ]
    other_driver = slice_([dev("nic-0", "NIC-0")], driver="example.com/nic")
    old_gen = slice_([dev("gpu-9", "GPU-9999")], gen=0)
    devices, skipped = parse_slices([slice_([good, *bad]), other_driver, old_gen, {}], NODE)
    assert [d.name for d in devices] == ["gpu-0"]
    assert skipped == len(bad)
    qualified = {"name": "gpu-5", "attributes": {f"{DRIVER}/uuid": {"string": "GPU-5"},
                                                 f"{DRIVER}/type": {"string": "gpu"}}}  # fmt: skip
    assert parse_slices([slice_([qualified])], NODE)[0][0].uuid == "GPU-5"


def test_a_device_without_a_type_is_no_gpu_to_the_agent_either() -> None:
    """The one rule (kube/draslices.py): no `type` attribute, not a GPU; the extender
    does not count it, and the agent neither taints nor attributes it."""
    untyped = {"name": "gpu-6", "attributes": {"uuid": {"string": "GPU-6"}}}
    devices, skipped = parse_slices([slice_([dev("gpu-0", "GPU-0"), untyped])], NODE)
    assert [d.name for d in devices] == ["gpu-0"] and skipped == 1


def test_claim_devices_resolve_to_gpu_and_mig_uuids_for_attribution() -> None:
    devices = [dev("gpu-0", "GPU-0000"), dev("gpu-1-mig-9-0-1", "MIG-a", "mig", "GPU-0001")]
    api, clock = FakeApi([slice_(devices)]), Clock()
    idx = SliceIndex(api, NODE, clock=clock)

    from gpudaemon.podresources._gen import api_pb2

    def res(driver: str, device: str) -> Any:
        return api_pb2.ClaimResource(driver_name=driver, pool_name=NODE, device_name=device)

    claim = api_pb2.DynamicResource(
        claim_name="gpus",
        claim_namespace="ns",
        claim_resources=[
            res(DRIVER, "gpu-0"),
            res(DRIVER, "gpu-1-mig-9-0-1"),
            res("example.com/nic", "nic-0"),
            res(DRIVER, "gpu-7"),  # not in the slice
            res(DRIVER, ""),
        ],
    )

    ref = PodRef("p", "ns", "c")
    got = list(_dra_assignments([claim], idx.uuid_of, ref))
    assert [(a.device_id, a.resource) for a in got] == [
        ("GPU-0000", DRA_RESOURCE),
        ("MIG-a", DRA_RESOURCE),
    ]
    reads = api.calls.count("LIST resourceslices")
    list(_dra_assignments([claim], idx.uuid_of, ref))
    assert api.calls.count("LIST resourceslices") == reads  # misses re-read at most per period


def test_a_cluster_without_the_v1_api_is_one_line_naming_the_release() -> None:
    from loguru import logger

    class OldApi(FakeApi):
        def list_items(self, path: str, query: Any = None, page_size: int = 500) -> Any:
            if path.endswith("devicetaintrules"):
                raise KubeNotFoundError(f"GET {path}: HTTP 404: the server could not find it", 404)
            return super().list_items(path, query, page_size)

    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(str(m)), level="INFO")
    try:
        api, clock = OldApi([slice_(H100)]), Clock()
        t = make(api, clock)
        for _ in range(3):
            assert t.sync({"GPU-0000": "xid 79"}) is False
            clock.t += 100
    finally:
        logger.remove(sink)
    said = [x for x in lines if "Kubernetes 1.37 or newer is needed" in x]
    assert len(said) == 1 and api.rules == {}


def test_a_rule_of_another_pool_labelled_with_our_node_is_not_ours() -> None:
    """Another node's agent may label a rule of its own pool with our node: deleting it
    would be refused to us (the policy), so it is not taken for ours, and our own
    rules still converge."""
    api, clock = FakeApi([slice_(H100)]), Clock()
    body = rule_body(
        "gpudaemon.io/", "gpu-9", DraDevice("gpu-9", "gpu-1", "GPU-x"), "NoSchedule", "x"
    )
    name = body["metadata"]["name"]
    body["metadata"]["labels"]["gpudaemon.io/node"] = NODE
    api.rules[name] = body
    api.rules["junk"] = {"metadata": {"name": "junk", "labels": dict(body["metadata"]["labels"])},
                         "spec": "not a spec"}  # fmt: skip
    assert make(api, clock).sync({"GPU-0002": "xid 48"}) is True
    assert sorted(api.rules) == sorted([name, "junk", rule_name(NODE, "gpu-2")])


def test_a_failing_slice_read_is_tried_at_most_once_per_period_not_per_claim_device() -> None:
    """An API server that fails (or forbids) the slice list: a kubelet answer with
    thousands of claim devices costs one list per re-read period, not one per device
    (each of which could wait out a request timeout)."""
    from gpudaemon.podresources._gen import api_pb2

    api, clock = FakeApi([slice_(H100)]), Clock()
    idx = SliceIndex(api, NODE, reread_after_s=30, clock=clock)
    api.down = True
    claim = api_pb2.DynamicResource(
        claim_name="many",
        claim_namespace="ns",
        claim_resources=[
            api_pb2.ClaimResource(driver_name=DRIVER, pool_name=NODE, device_name=f"gpu-{i}")
            for i in range(2000)
        ],
    )
    assert list(_dra_assignments([claim], idx.uuid_of, PodRef("p", "ns", "c"))) == []
    assert api.calls.count("LIST resourceslices") == 1
    with pytest.raises(KubeUnavailableError):  # the taint writer still sees the failure
        idx.for_gpu("GPU-0001")
    assert api.calls.count("LIST resourceslices") == 1
    api.down = False
    clock.t += 31
    got = list(_dra_assignments([claim], idx.uuid_of, PodRef("p", "ns", "c")))
    assert [a.device_id for a in got] == [f"GPU-{i:04d}" for i in range(8)]
    assert api.calls.count("LIST resourceslices") == 2


def test_a_rule_of_the_same_name_made_by_someone_else_is_never_taken_over() -> None:
    """A rule named as ours would be, but without our labels (an admin's, another
    tool's): not overwritten (one line, counted), and never deleted when healthy."""
    from loguru import logger

    api, clock = FakeApi([slice_(H100)]), Clock()
    name = rule_name(NODE, "gpu-3")
    theirs = {"metadata": {"name": name, "labels": {"team": "ops"}},
              "spec": {"deviceSelector": {"driver": DRIVER, "pool": NODE, "device": "gpu-3"},
                       "taint": {"key": "ops/maintenance", "effect": "NoSchedule"}}}  # fmt: skip
    api.rules[name] = theirs
    results: list[str] = []
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(str(m)), level="INFO")
    try:
        slices = SliceIndex(api, NODE, reread_after_s=30, clock=clock)
        t = DeviceTaints(api, NODE, slices, prefix="gpudaemon.io/", clock=clock,
                         rng=lambda: 1.0, on_write=results.append)  # fmt: skip
        for _ in range(3):
            t.sync({"GPU-0003": "xid 79", "GPU-0004": "xid 79"})
            clock.t += 700  # past the resync: listed and checked again
        assert api.rules[name] == theirs
        assert sorted(api.rules) == sorted([name, rule_name(NODE, "gpu-4")])
        t.sync({})
        clock.t += 700
        t.retry()
    finally:
        logger.remove(sink)
    assert api.rules == {name: theirs}
    assert not any(c == f"APPLY {name}" or c == f"DELETE {name}" for c in api.calls)
    assert sum("not ours" in x for x in lines) == 1
    assert "foreign" in results
