"""`gpudaemon status` and the extender's per-node gauges are one set of figures (issue 18):
the same objects give the same total, healthy, allocated, free and fresh, through the
extender's ClusterState. The end-to-end check with real agents is in
tests/integration/status/."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry

from gpudaemon.extender.cluster import ClusterState
from gpudaemon.extender.metrics import NodeCollector
from gpudaemon.status import as_json, as_table, collect
from tests.clock import FakeClock
from tests.unit.extender.test_cluster import P, lease_obj, node_obj, pod_obj

NOW = 1_800_000_000.0


def objects() -> dict[str, list[dict[str, Any]]]:
    lost = node_obj("b", healthy=7, uid="ub")
    lost["metadata"]["annotations"][P + "gpus"] = json.dumps(
        [{"index": 5, "uuid": "GPU-5", "memory_total_mib": 1, "healthy": False,
          "reason": "gpu lost"}]
    )  # fmt: skip
    cpu_only = {"metadata": {"name": "cpu", "uid": "uc", "labels": {}}, "status": {}}
    return {
        "/api/v1/nodes": [node_obj("a", uid="ua"), lost, node_obj("c", uid="uc2"), cpu_only],
        "leases": [
            lease_obj("a", NOW - 10, 360, owner_uid="ua"),
            lease_obj("b", NOW - 20, 360, owner_uid="ub"),
            lease_obj("c", NOW - 400, 360, owner_uid="uc2"),  # expired: a stopped agent
        ],
        "/api/v1/pods": [
            pod_obj("p1", "a", gpus=3, phase="Running"),
            pod_obj("p2", "a", gpus=1, phase="Running"),
            pod_obj("p3", "b", gpus=2, phase="Running"),
        ],
    }


class FakeClient:
    def __init__(self, objs: Mapping[str, list[dict[str, Any]]]) -> None:
        self.objs = objs

    def list_items(
        self, path: str, query: Mapping[str, str] | None = None
    ) -> tuple[list[dict[str, Any]], str]:
        key = "leases" if "leases" in path else path
        return list(self.objs[key]), "1"

    def pages(
        self, path: str, query: Mapping[str, str] | None = None
    ) -> Iterator[tuple[list[dict[str, Any]], str]]:
        items, rv = self.list_items(path, query)
        for i in range(0, len(items), 2):  # pages of two
            yield items[i : i + 2], rv


def rows() -> list[Any]:
    return collect(FakeClient(objects()), prefix=P, lease_namespace="gpudaemon", now=NOW)  # type: ignore[arg-type]


def test_status_counts_per_node() -> None:
    got = {r.name: (r.total, r.healthy, r.allocated, r.free, r.fresh, r.age_s) for r in rows()}
    assert got == {
        "a": (8, 8, 4, 4, True, 10.0),
        "b": (8, 7, 2, 5, True, 20.0),  # the unhealthy GPU is neither healthy nor free
        "c": (8, 8, 0, 8, False, 400.0),
    }  # the CPU-only node is not a GPU node
    out = json.loads(as_json(rows()))
    assert out["nodes"][1]["unhealthy"] == [{"index": 5, "reason": "gpu lost"}]
    assert set(out["nodes"][0]) == {
        "name", "product", "total", "healthy", "allocated", "free", "fresh", "age_s", "unhealthy",
        "bad_data",
    }  # fmt: skip
    (s,) = out["summary"]
    # a stale node's GPUs are not on offer: its free GPUs are left out of the summary
    assert (s["nodes"], s["stale_nodes"], s["free"], s["allocated"]) == (3, 1, 9, 6)
    table = as_table(rows())
    assert "b     NVIDIA-H100  8      7        2          5     yes" in table
    assert "5: gpu lost" in table


def test_the_extender_gauges_are_the_same_figures() -> None:
    objs = objects()
    cluster = ClusterState(P, wall=FakeClock(NOW))
    cluster.replace_nodes(objs["/api/v1/nodes"])
    cluster.replace_leases(objs["leases"])
    cluster.replace_pods(objs["/api/v1/pods"])
    reg = CollectorRegistry()
    reg.register(NodeCollector(cluster))
    for r in rows():
        for kind in ("total", "healthy", "allocated", "free"):
            v = reg.get_sample_value("gpudaemon_extender_node_gpus", {"node": r.name, "kind": kind})
            assert v == getattr(r, kind), (r.name, kind)
        assert reg.get_sample_value("gpudaemon_extender_node_fresh", {"node": r.name}) == r.fresh
    assert reg.get_sample_value("gpudaemon_extender_node_fresh", {"node": "cpu"}) is None
