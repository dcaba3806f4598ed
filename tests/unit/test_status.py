"""`gpudaemon status` and the extender's per-node gauges are one set of figures (issue 18):
the same objects give the same total, healthy, allocated, free and fresh, through the
extender's ClusterState. A node without fresh data shows its healthy and free GPUs as
unknown and says why; the agents' Leases are found by label when no namespace is given
(issue 28). The end-to-end check with real agents is in tests/integration/status/."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from gpudaemon.cluster.clusterstate import ClusterState
from gpudaemon.errors import KubeForbiddenError, KubeNotFoundError
from gpudaemon.extender.metrics import NodeCollector
from gpudaemon.kube.client import NODE_LEASE_LABELS, NODE_LEASE_SELECTOR
from gpudaemon.status import as_json, as_table, collect
from tests.clock import FakeClock
from tests.unit.extender.test_cluster import P, lease_obj, node_obj, pod_obj

NOW = 1_800_000_000.0


def objects() -> dict[str, list[dict[str, Any]]]:
    lost = node_obj("b", healthy=7, uid="ub")
    lost["metadata"]["annotations"][P + "gpus"] = json.dumps(
        [{"index": 2, "uuid": "GPU-2", "memory_total_mib": 1, "healthy": True,
          "state": "degraded", "action": "watch", "reason": "clock event hw_slowdown"},
         {"index": 5, "uuid": "GPU-5", "memory_total_mib": 1, "healthy": False,
          "state": "unhealthy", "action": "reboot_node", "reason": "gpu lost"}]
    )  # fmt: skip
    cpu_only = {"metadata": {"name": "cpu", "uid": "uc", "labels": {}}, "status": {}}
    return {
        "/api/v1/nodes": [
            node_obj("a", uid="ua", util=[0] * 8),
            lost,
            node_obj("c", uid="uc2", util=[0] * 8),
            cpu_only,
        ],
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
    """Leases listed in one namespace are `objs["leases"]`; listed across namespaces
    with the agents' label, `objs["labelled"]` (none by default: agents older than the
    label), or a 403 when `forbidden`."""

    def __init__(self, objs: Mapping[str, list[dict[str, Any]]], forbidden: bool = False):
        self.objs, self.forbidden = objs, forbidden
        self.calls: list[tuple[str, dict[str, str]]] = []

    def list_items(
        self, path: str, query: Mapping[str, str] | None = None
    ) -> tuple[list[dict[str, Any]], str]:
        self.calls.append((path, dict(query or {})))
        if path == "/apis/coordination.k8s.io/v1/leases":
            assert (query or {}).get("labelSelector") == NODE_LEASE_SELECTOR
            if self.forbidden:
                raise KubeForbiddenError("GET leases: HTTP 403: forbidden", 403)
            return list(self.objs.get("labelled", [])), "1"
        key = "leases" if "leases" in path else path
        if key not in self.objs and path.startswith("/apis/resource.k8s.io/"):
            raise KubeNotFoundError(f"GET {path}: HTTP 404: the server could not find it", 404)
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
        "c": (8, None, 0, None, False, 400.0),  # a stopped agent: health unknown
    }  # the CPU-only node is not a GPU node
    out = json.loads(as_json(rows()))
    assert out["nodes"][1]["unhealthy"] == [
        {"index": 5, "reason": "gpu lost", "state": "unhealthy", "action": "reboot_node"}
    ]
    assert out["nodes"][1]["degraded"] == [
        {"index": 2, "reason": "clock event hw_slowdown", "state": "degraded", "action": "watch"}
    ]
    assert (out["nodes"][0]["unhealthy"], out["nodes"][0]["degraded"]) == ([], [])
    assert set(out["nodes"][0]) == {
        "name", "product", "total", "healthy", "allocated", "free", "fresh", "age_s",
        "unhealthy", "degraded", "stale_reason", "bad_data", "unavailable",
    }  # fmt: skip
    c = out["nodes"][2]
    assert (c["healthy"], c["free"], c["unhealthy"], c["degraded"]) == (None, None, None, None)
    assert c["stale_reason"] == "the Lease expired 40s ago"
    assert out["nodes"][0]["stale_reason"] is None
    (s,) = out["summary"]
    # a stale node's GPUs are neither known healthy nor on offer: left out of the summary
    assert (s["nodes"], s["stale_nodes"], s["healthy"], s["free"], s["allocated"]) == (
        3, 1, 15, 9, 6)  # fmt: skip
    assert s["degraded"] == 1  # the degraded GPU is schedulable: among the healthy
    table = as_table(rows())
    assert "b     NVIDIA-H100  8      7        2          5     yes" in table
    assert "c     NVIDIA-H100  8      -        0          -     NO" in table
    assert "stale: the Lease expired 40s ago" in table
    lines = {ln.split()[0]: ln.split(None, 9) for ln in table.splitlines()[1:4]}
    assert lines["b"][8:] == [
        "2=degraded/watch,5=unhealthy/reboot_node",
        "2: clock event hw_slowdown, 5: gpu lost",
    ]
    assert lines["a"][8:] == ["-", "-"]
    assert lines["c"][8] == "-"  # stale: nothing known of its GPUs
    assert "NVIDIA-H100  -     3      1      24     15       1         6          9" in table


def test_an_agent_older_than_the_verdict_shows_its_unhealthy_gpus_without_an_action() -> None:
    objs = objects()
    objs["/api/v1/nodes"][1]["metadata"]["annotations"][P + "gpus"] = json.dumps(
        [{"index": 5, "uuid": "GPU-5", "memory_total_mib": 1, "healthy": False,
          "reason": "gpu lost"}]
    )  # fmt: skip
    got = collect(FakeClient(objs), prefix=P, lease_namespace="gpudaemon", now=NOW)  # type: ignore[arg-type]
    out = json.loads(as_json(got))
    assert out["nodes"][1]["unhealthy"] == [
        {"index": 5, "reason": "gpu lost", "state": "unhealthy", "action": ""}
    ]
    assert out["nodes"][1]["degraded"] == []
    assert " 5=unhealthy " in as_table(got)


def stale_reasons(objs: dict[str, list[dict[str, Any]]]) -> dict[str, str | None]:
    got = collect(FakeClient(objs), prefix=P, lease_namespace="gpu-ops", now=NOW)  # type: ignore[arg-type]
    return {r.name: r.stale_reason for r in got}


def test_a_node_without_fresh_data_says_why_and_shows_no_healthy_gpus() -> None:
    def n(name: str, **kw: Any) -> dict[str, Any]:
        return node_obj(name, uid=f"u-{name}", **kw)

    no_agent = {"metadata": {"name": "no-agent", "uid": "u-no-agent", "labels": {}},
                "status": {"allocatable": {"nvidia.com/gpu": "8"}}}  # fmt: skip
    poisoned = n("poisoned", util=[0])
    poisoned["metadata"]["annotations"][P + "gpus"] = "{not json"
    malformed = lease_obj("malformed", NOW, 360, owner_uid="u-malformed")
    del malformed["spec"]["renewTime"]
    objs = {
        "/api/v1/nodes": [
            no_agent, n("ok", util=[0]), n("expired", util=[0]), n("replaced", util=[0]),
            n("malformed", util=[0]), n("no-annotation"), poisoned,
        ],
        "leases": [
            lease_obj("ok", NOW - 1, 360, owner_uid="u-ok"),
            lease_obj("expired", NOW - 3960, 360, owner_uid="u-expired"),
            lease_obj("replaced", NOW - 1, 360, owner_uid="an-older-node"),
            malformed,
            lease_obj("no-annotation", NOW - 1, 360, owner_uid="u-no-annotation"),
            lease_obj("poisoned", NOW - 1, 360, owner_uid="u-poisoned"),
        ],
        "/api/v1/pods": [],
    }  # fmt: skip
    assert stale_reasons(objs) == {
        "no-agent": "no agent Lease in namespace gpu-ops",
        "ok": None,
        "expired": "the Lease expired 60m ago",
        "replaced": "the Lease belongs to an earlier Node of this name",
        "malformed": "the Lease has no valid renewTime or leaseDurationSeconds",
        "no-annotation": "no gpudaemon.io/gpus annotation",
        "poisoned": "agent data unreadable: gpus: not JSON (unexpected character, expected a string key: line 1 column 2 (char 1))",
    }
    got = collect(FakeClient(objs), prefix=P, lease_namespace="gpu-ops", now=NOW)  # type: ignore[arg-type]
    row = next(r for r in got if r.name == "no-agent")
    # The case: a node with no agent showed HEALTHY 8, FREE 8.
    assert (row.total, row.healthy, row.free, row.fresh) == (8, None, None, False)
    line = next(ln for ln in as_table(got).splitlines() if ln.startswith("no-agent"))
    assert line.split()[:7] == ["no-agent", "-", "8", "-", "0", "-", "NO"]


def labelled(lease: dict[str, Any], namespace: str) -> dict[str, Any]:
    lease["metadata"].update(namespace=namespace, labels=dict(NODE_LEASE_LABELS))
    return lease


def test_without_a_namespace_the_agents_leases_are_found_by_their_label() -> None:
    objs = objects()
    objs["leases"] = []  # nothing in the configured namespace
    objs["labelled"] = [
        labelled(lease_obj("a", NOW - 10, 360, owner_uid="ua"), "gpu-ops"),
        labelled(lease_obj("b", NOW - 20, 360, owner_uid="ub"), "gpu-ops"),
        # Another release's older Lease for the same node: the later renewal counts.
        labelled(lease_obj("a", NOW - 900, 360, owner_uid="ua"), "old-release"),
    ]
    client = FakeClient(objs)
    got = {r.name: r.stale_reason for r in collect(client, prefix=P, lease_namespace=None, now=NOW)}  # type: ignore[arg-type]
    assert got == {"a": None, "b": None,
                   "c": "no agent Lease in namespaces gpu-ops, old-release"}  # fmt: skip
    assert not [p for p, _ in client.calls if "/namespaces/" in p]  # one list, no fallback


@pytest.mark.parametrize("forbidden", [False, True])
def test_with_no_labelled_lease_found_the_configured_namespace_is_read(forbidden: bool) -> None:
    """Agents older than the label, or no right to list Leases across namespaces."""
    client = FakeClient(objects(), forbidden=forbidden)
    got = collect(client, prefix=P, lease_namespace=None, fallback_namespace="gpudaemon",  # type: ignore[arg-type]
                  now=NOW)  # fmt: skip
    assert [r.fresh for r in got] == [True, True, False]
    assert "/apis/coordination.k8s.io/v1/namespaces/gpudaemon/leases" in [
        p for p, _ in client.calls
    ]


def test_the_extender_gauges_are_the_same_figures() -> None:
    objs = objects()
    cluster = ClusterState(P, wall=FakeClock(NOW))
    cluster.replace_nodes(objs["/api/v1/nodes"])
    cluster.replace_leases(objs["leases"])
    cluster.replace_pods(objs["/api/v1/pods"])
    reg = CollectorRegistry()
    reg.register(NodeCollector(cluster))
    for r in rows():
        # A stale node's health is unknown to status; the gauges keep the last figures
        # beside `fresh` 0.
        kinds = ("total", "healthy", "allocated", "free") if r.fresh else ("total", "allocated")
        for kind in kinds:
            v = reg.get_sample_value("gpudaemon_extender_node_gpus", {"node": r.name, "kind": kind})
            assert v == getattr(r, kind), (r.name, kind)
        assert reg.get_sample_value("gpudaemon_extender_node_fresh", {"node": r.name}) == r.fresh
    assert reg.get_sample_value("gpudaemon_extender_node_fresh", {"node": "cpu"}) is None


@pytest.mark.parametrize(
    ("spec", "ready", "why"),
    [
        ({"unschedulable": True}, "True", "cordoned"),
        ({}, "Unknown", "NotReady (NodeStatusUnknown)"),
        ({}, "False", "NotReady (KubeletNotReady)"),
    ],
)
def test_a_cordoned_or_notready_node_has_no_free_gpus_and_says_why(
    spec: dict[str, Any], ready: str, why: str
) -> None:
    objs = objects()
    a = objs["/api/v1/nodes"][0]
    a["spec"] = {**a.get("spec", {}), **spec}
    reason = {"True": "KubeletReady", "Unknown": "NodeStatusUnknown", "False": "KubeletNotReady"}
    a["status"]["conditions"] = [{"type": "Ready", "status": ready, "reason": reason[ready]}]
    got = {r.name: r for r in collect(FakeClient(objs), prefix=P, lease_namespace="gpudaemon",
                                      now=NOW)}  # type: ignore[arg-type]  # fmt: skip
    assert (got["a"].free, got["a"].unavailable, got["a"].healthy) == (0, why, 8)
    assert got["b"].free == 5 and got["b"].unavailable == ""
    table = as_table(list(got.values()))
    line = next(x for x in table.splitlines() if x.startswith("a "))
    assert f"{why}: 0 free" in line
    summary = next(x for x in table.splitlines()[5:] if x.startswith("NVIDIA"))
    assert summary.split()[-1] == "5", table  # only b's free GPUs are on offer


def test_a_released_lease_says_the_agent_stopped() -> None:
    objs = objects()
    released = lease_obj("c", NOW - 3, 1, owner_uid="uc2")
    released["spec"]["holderIdentity"] = ""
    objs["leases"][2] = released
    c = next(r for r in collect(FakeClient(objs), prefix=P, lease_namespace="gpudaemon",
                                now=NOW) if r.name == "c")  # type: ignore[arg-type]  # fmt: skip
    assert not c.fresh
    assert c.stale_reason == "the agent stopped (released its Lease) 2s ago"


def test_on_a_dra_cluster_status_counts_what_the_extender_counts() -> None:
    """GPUs published in ResourceSlices and devices allocated to claims: the same
    ClusterState, fed the same objects as the extender's DRA informers, gives the same
    total and free; a pool in two generations counts once."""
    from tests.dra_objects import claim, device_class, nvidia_slice

    node = node_obj("d", uid="ud", util=[0] * 8)
    node["status"]["allocatable"].pop("nvidia.com/gpu", None)
    node["status"]["capacity"] = {}
    old, new = nvidia_slice("d", name="d-old"), nvidia_slice("d", name="d-new")
    new["spec"]["pool"]["generation"] = 2
    held = claim("train", 3, allocated=("d", ["gpu-0", "gpu-1", "gpu-2"]))
    objs = {
        "/api/v1/nodes": [node],
        "leases": [lease_obj("d", NOW - 10, 360, owner_uid="ud")],
        "/api/v1/pods": [],
        "/apis/resource.k8s.io/v1/resourceslices": [old, new],
        "/apis/resource.k8s.io/v1/resourceclaims": [held],
        "/apis/resource.k8s.io/v1/deviceclasses": [device_class()],
        "/apis/resource.k8s.io/v1/resourceclaimtemplates": [],
    }  # devicetaintrules: not served (404), as before 1.37
    [row] = collect(FakeClient(objs), prefix=P, lease_namespace="gpudaemon", now=NOW)
    cluster = ClusterState(P, wall=lambda: NOW, dra=True)
    cluster.replace_nodes([node])
    cluster.replace_leases(objs["leases"])
    for kind in ("resourceslices", "resourceclaims", "deviceclasses"):
        cluster.dra_replace(kind)(objs[f"/apis/resource.k8s.io/v1/{kind}"])
    st = cluster.snapshot(["d"]).states["d"]
    assert st is not None
    assert (row.total, row.free) == (8, st.gpus_free) == (8, 5)
