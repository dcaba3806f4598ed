"""What one node writes cannot stop another program (issue 28): a poisoned `gpus`
annotation or count label makes that node "no data" in the extender's cluster state
(filtered with a reason, never fresh), in the rebalancer (no drain, no defrag) and in
`status`, counted once per node and value; the reflector takes a list whose handler
fails on one object object by object, and a handler that raises ends no watch."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
from loguru import logger
from prometheus_client import CollectorRegistry

from gpudaemon.cluster.clusterstate import ClusterState
from gpudaemon.cluster.metrics import BadDataCollector
from gpudaemon.cluster.scoring import check_node
from gpudaemon.cluster.state import PodShape
from gpudaemon.kube.backoff import Backoff
from gpudaemon.kube.informer import Reflector
from gpudaemon.status import as_json, as_table, collect
from tests.unit.extender.test_cluster import lease_obj, node_obj
from tests.unit.extender.test_informer import ScriptedClient, obj
from tests.unit.rebalancer.test_rebalancer import load, metric, node, pod, rig

P = "gpudaemon.io/"
NOW = 1_000_000.0
DEEP = "[" * 50_000 + "]" * 50_000
# Each a value a node's identity may write; each must make that node "no data".
POISON: dict[str, tuple[str, str]] = {
    "deep": ("annotations", DEEP),
    "orjson_depth": ("annotations", "[" * 1023 + "]" * 1023),
    "huge": ("annotations", json.dumps([{"index": 0, "uuid": "x" * 250_000}])),
    "wrong_types": ("annotations", '[{"index":"0","uuid":1,"memory_total_mib":[]}]'),
    "not_a_list": ("annotations", '{"index":0}'),
    "nan": ("annotations", '[{"index":0,"uuid":"G","memory_total_mib":NaN}]'),
    "count_label": ("labels", "99999999"),
}


def poisoned(name: str, case: str, uid: str = "u1") -> dict[str, Any]:
    o = node_obj(name, uid=uid, util=[50] * 8)
    where, value = POISON[case]
    if where == "annotations":
        o["metadata"]["annotations"][P + "gpus"] = value
    else:
        o["metadata"]["labels"][P + "gpu.count"] = value
    return o


@pytest.fixture
def logs() -> Any:
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(str(m)), level="INFO", format="{message}")
    yield lines
    logger.remove(sink)


@pytest.mark.parametrize("case", sorted(POISON))
def test_a_poisoned_node_is_no_data_and_its_neighbours_are_untouched(case: str) -> None:
    c = ClusterState(P, wall=lambda: NOW)
    c.replace_nodes([poisoned("bad", case), node_obj("good", uid="u2", util=[50] * 8)])
    c.replace_leases([lease_obj("bad", NOW - 10), lease_obj("good", NOW - 10, owner_uid="u2")])
    snap = c.snapshot(["bad", "good"])
    assert snap.fresh == {"bad": False, "good": True}
    bad, good = snap.states["bad"], snap.states["good"]
    assert bad is not None and good is not None
    key = "gpu.count" if case == "count_label" else "gpus"
    assert bad.bad_data.startswith(key + ": ") and c.bad_reason("bad") == bad.bad_data
    assert bad.utilization_ratio is None and bad.gpus_total == 0
    why = check_node(bad, PodShape(gpus=1), fresh=snap.fresh["bad"])
    assert why is not None and why.reason == "bad_data" and "unreadable" in why.message
    assert check_node(good, PodShape(gpus=1), fresh=True) is None
    assert good.utilization_ratio == 0.5 and not good.bad_data
    assert c.bad_counts() == {key: 1}


def test_a_bad_value_is_logged_and_counted_once_per_node_and_value(logs: list[str]) -> None:
    c = ClusterState(P, wall=lambda: NOW)
    for _ in range(3):  # the node re-sends it with every write; a relist sees it again
        c.node_event("MODIFIED", poisoned("bad", "deep"))
    c.replace_nodes([poisoned("bad", "deep")])
    assert c.bad_counts() == {"gpus": 1}
    assert sum("ignoring its gpus" in line for line in logs) == 1
    c.node_event("MODIFIED", poisoned("bad", "wrong_types"))  # a new bad value: once more
    assert c.bad_counts() == {"gpus": 2}
    c.node_event("MODIFIED", node_obj("bad"))
    c.lease_event("ADDED", lease_obj("bad", NOW - 10))
    assert c.fresh("bad") and not c.bad_reason("bad")
    assert any("readable again" in line for line in logs)
    assert not any(DEEP[:100] in line for line in logs)  # never the value itself


def test_freshness_returns_when_the_node_writes_a_readable_value() -> None:
    c = ClusterState(P, wall=lambda: NOW)
    c.replace_nodes([poisoned("n", "deep")])
    c.replace_leases([lease_obj("n", NOW - 10)])
    assert not c.fresh("n")
    c.node_event("MODIFIED", node_obj("n"))
    assert c.fresh("n")
    c.node_event("MODIFIED", poisoned("n", "huge"))
    assert not c.fresh("n")
    c.node_event("DELETED", poisoned("n", "huge"))
    assert not c.bad_reason("n")


@pytest.mark.parametrize(
    "thing",
    [
        {"metadata": {"name": "n", "labels": ["not", "a", "map"]}},
        {"metadata": {"name": "n"}, "status": {"allocatable": "8"}},
        {"metadata": {"name": "n"}, "status": {"allocatable": {"cpu": "1e300"}}},
        {"metadata": "nope"},
    ],
)
def test_a_node_object_of_a_shape_no_api_server_stores_is_no_data_not_a_crash(
    thing: dict[str, Any],
) -> None:
    c = ClusterState(P, wall=lambda: NOW)
    c.replace_nodes([thing, node_obj("good", uid="u2")])
    assert c.states(["good"])["good"] is not None


def test_a_lease_renewed_at_the_end_of_time_vouches_for_nothing() -> None:
    c = ClusterState(P, wall=lambda: NOW)
    c.replace_nodes([node_obj("n")])
    lease = lease_obj("n", NOW, duration=2**31 - 1)
    lease["spec"]["renewTime"] = "9999-12-31T23:59:59.999999Z"
    c.replace_leases([lease])
    assert not c.fresh("n")


def test_the_metric_counts_bad_values_by_key_from_zero() -> None:
    c = ClusterState(P, wall=lambda: NOW)
    c.replace_nodes([poisoned("a", "deep"), poisoned("b", "count_label")])
    reg = CollectorRegistry()
    reg.register(BadDataCollector("extender", c.bad_counts, lambda: {"nodes": 2}))
    get = reg.get_sample_value
    assert get("gpudaemon_extender_bad_node_values_total", {"key": "gpus"}) == 1
    assert get("gpudaemon_extender_bad_node_values_total", {"key": "gpu.count"}) == 1
    assert get("gpudaemon_extender_bad_node_values_total", {"key": "gpu.healthy"}) == 0
    assert get("gpudaemon_extender_watch_handler_errors_total", {"kind": "nodes"}) == 2


# -- the reflector ----------------------------------------------------------------------


def test_a_handler_that_fails_on_one_object_neither_fails_the_list_nor_ends_the_watch(
    logs: list[str],
) -> None:
    stop = threading.Event()
    client = ScriptedClient(
        [([obj("a", "1"), obj("boom", "2"), obj("c", "3")], "10")],
        [
            [
                ("ADDED", obj("boom", "11")),
                ("MODIFIED", obj("boom", "12")),
                ("ADDED", obj("d", "13")),
            ]
        ],
        stop,
    )
    seen: dict[str, Any] = {}

    def replace(items: list[dict[str, Any]]) -> None:
        seen.clear()
        for i in items:
            event("ADDED", i)

    def event(kind: str, o: dict[str, Any]) -> None:
        name = o["metadata"]["name"]
        if name == "boom":
            raise RecursionError("maximum recursion depth exceeded")
        seen[name] = kind

    r = Reflector(client, "nodes", "/api/v1/nodes", replace, event,
                  backoff=Backoff(1, 8, rng=lambda: 1.0))  # fmt: skip
    r.run(stop)
    assert r.synced.is_set() and client.calls[:2] == [("list", "10"), ("watch", "10")]
    assert seen == {"a": "ADDED", "c": "ADDED", "d": "ADDED"}
    assert r.handler_errors == 3 and r.relists == 0  # the list's one and two events
    assert sum("skipped boom" in line for line in logs) == 1


# -- the rebalancer -----------------------------------------------------------------------


@pytest.mark.parametrize("case", ["deep", "wrong_types", "count_label"])
def test_the_rebalancer_drains_nothing_on_a_poisoned_node_and_still_acts_on_others(
    case: str,
) -> None:
    rb, kube, clock = rig(apply=True, grace_s=0)
    bad = node("n1", sick={0: ["ml/a"]})
    where, value = POISON[case]
    key = P + ("gpus" if where == "annotations" else "gpu.count")
    bad["metadata"][where][key] = value
    load(rb, clock, [bad, node("n2", sick={0: ["ml/b"]})], [pod("a", "n1"), pod("b", "n2")])
    nodes, gpu_states, _ = rb.facts()
    assert "n1" not in nodes and "n1" not in gpu_states and "n2" in gpu_states
    rb.run_pass()
    assert kube.evictions == [("ml/b", False)]  # n2's sick GPU is drained, n1 left alone
    k = "gpu.count" if case == "count_label" else "gpus"
    assert metric(rb, "gpudaemon_rebalancer_bad_node_values_total", key=k) == 1


# -- status -------------------------------------------------------------------------------


class _Client:
    def __init__(self, nodes: list[dict[str, Any]], leases: list[dict[str, Any]]) -> None:
        self.nodes, self.leases = nodes, leases

    def list_items(self, path: str, query: Any = None) -> tuple[list[dict[str, Any]], str]:
        return (self.nodes if path.endswith("/nodes") else self.leases), "1"

    def pages(self, path: str, query: Any = None) -> Any:
        yield [], "1"


def test_status_lists_the_others_and_shows_the_poisoned_node_as_no_data() -> None:
    nodes = [poisoned("bad", "orjson_depth"), node_obj("good", uid="u2", util=[0] * 8)]
    leases = [lease_obj("bad", NOW - 10), lease_obj("good", NOW - 10, owner_uid="u2")]
    rows = collect(_Client(nodes, leases), prefix=P, lease_namespace="x", now=NOW)  # type: ignore[arg-type]
    by = {r.name: r for r in rows}
    assert by["good"].fresh and not by["good"].bad_data
    assert not by["bad"].fresh and by["bad"].bad_data.startswith("gpus: nested deeper")
    assert "agent data unreadable: gpus: nested deeper" in as_table(rows)
    assert json.loads(as_json(rows))["nodes"][0]["bad_data"].startswith("gpus:")
