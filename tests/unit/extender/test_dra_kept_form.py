"""What the DRA watches keep: each object parsed into its kept form as its list page or
watch event arrives (the raw page is gone before the next is read), small pages for the
kinds tenants write, and a store fed kept forms that reads as one fed raw objects."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from gpudaemon.cluster.clusterstate import ClusterState
from gpudaemon.cluster.dra import KEPT, Claim, kept_form
from gpudaemon.cluster.drawatch import PAGE_SIZE, dra_informers
from gpudaemon.cluster.state import PodShape
from gpudaemon.kube.client import KubeClient
from gpudaemon.kube.informer import Reflector
from gpudaemon.kube.informers import InformerFactory
from tests.dra_objects import claim, device_class, dra_pod, nvidia_slice, taint_rule, template
from tests.unit.extender.test_dra_cluster import dra_node

Obj = dict[str, Any]


def padded_claim(name: str, count: int = 1) -> Obj:
    """A claim with 100 KB of opaque parameters the extender never reads."""
    c = claim(name, count)
    c["spec"]["devices"]["config"] = [
        {"opaque": {"driver": "gpu.nvidia.com", "parameters": {"pad": "x" * 100_000}}}
    ]
    return c


def test_a_kept_claim_is_its_parsed_value_and_four_metadata_fields() -> None:
    raw = padded_claim("big", 2)
    raw["metadata"].update(resourceVersion="7", labels={"a": "b"}, managedFields=[{}])
    kept = kept_form("resourceclaims")(raw)
    assert kept["metadata"] == {"name": "big", "namespace": "default", "uid": raw["metadata"]["uid"],
                                "resourceVersion": "7"}  # fmt: skip
    assert isinstance(kept[KEPT], Claim)
    assert len(json.dumps(kept, default=repr)) < 1_000 < len(json.dumps(raw))


def test_an_object_its_parser_refuses_is_counted_unreadable_as_a_raw_one_is() -> None:
    bad = claim("bad")
    bad["spec"]["devices"]["requests"] = "not a list"
    for form in (bad, kept_form("resourceclaims")(bad)):
        c = ClusterState(dra=True)
        c.dra_replace("resourceclaims")([form])
        assert c.dra_counts()[0] == {"resourceclaims": 1}


def test_a_store_fed_kept_forms_judges_pods_as_one_fed_raw_objects() -> None:
    objects = {
        "deviceclasses": [device_class()],
        "resourceslices": [nvidia_slice("n1")],
        "devicetaintrules": [taint_rule("t", "n1", "gpu-7")],
        "resourceclaimtemplates": [template("tpl", 3)],
        "resourceclaims": [padded_claim("want", 2),
                           claim("held", 1, allocated=("n1", ["gpu-0"]), reserved_for=["u"])],
    }  # fmt: skip
    states = []
    for keep in (False, True):
        c = ClusterState(dra=True)
        c.replace_nodes([dra_node("n1")])
        for kind, items in objects.items():
            c.dra_replace(kind)([kept_form(kind)(o) if keep else o for o in items])
        c.dra_event("resourceclaims")("ADDED", kept_form("resourceclaims")(claim("late", 4))
                                      if keep else claim("late", 4))  # fmt: skip
        pods = [dra_pod("", [("gpus", "claim:want")]), dra_pod("", [("gpus", "template:tpl")]),
                dra_pod("", [("gpus", "claim:late")])]  # fmt: skip
        shapes = [c.with_dra(p, PodShape(gpus=0)).gpus for p in pods]
        states.append((c.snapshot(["n1"]).states["n1"], shapes))
    assert states[0] == states[1]
    assert states[1][1] == [2, 3, 4]


def test_each_page_is_kept_before_the_next_is_asked_for() -> None:
    pages = [[padded_claim(f"c{i}-{j}") for j in range(3)] for i in range(3)]
    log: list[str] = []
    client = KubeClient.__new__(KubeClient)

    def request(method: str, path: str, query: Mapping[str, str] | None = None, **_: Any) -> Obj:
        q = dict(query or {})
        i = int(q.get("continue") or 0)
        log.append(f"GET page {i} limit {q.get('limit')}")
        cont = str(i + 1) if i + 1 < len(pages) else ""
        return {"metadata": {"resourceVersion": "9", "continue": cont}, "items": pages[i]}

    client.request = request  # type: ignore[method-assign]
    keep = kept_form("resourceclaims")

    def transform(o: Obj) -> Obj:
        log.append(f"keep {o['metadata']['name']}")
        return keep(o)

    items, rv = client.list_items("/claims", page_size=3, transform=transform)
    assert rv == "9" and [i["metadata"]["name"] for i in items][-1] == "c2-2"
    assert log[:5] == ["GET page 0 limit 3", "keep c0-0", "keep c0-1", "keep c0-2",
                       "GET page 1 limit 3"]  # fmt: skip
    assert all(KEPT in i for i in items)


class _Client:
    """Lists once, then plays one watch; records what list_items was asked."""

    def __init__(self, items: list[Obj], events: list[tuple[str, Obj]], stop: threading.Event):
        self.items, self.events, self.stop = items, events, stop
        self.list_kw: list[dict[str, Any]] = []

    def list_items(
        self,
        path: str,
        query: Mapping[str, str] | None = None,
        page_size: int = 500,
        transform: Callable[[Obj], Obj] | None = None,
    ) -> tuple[list[Obj], str]:
        self.list_kw.append({"page_size": page_size, "transform": transform is not None})
        return [transform(o) if transform else o for o in self.items], "1"

    def watch(self, path: str, resource_version: str, timeout_s: float = 300.0,
              query: Mapping[str, str] | None = None) -> Iterator[tuple[str, Obj]]:  # fmt: skip
        yield from self.events
        self.stop.set()

    def request(self, method: str, path: str, *, timeout_s: float | None = None) -> Obj:
        raise NotImplementedError


def test_the_claim_watch_lists_in_small_pages_and_keeps_events_in_kept_form() -> None:
    stop = threading.Event()
    late = padded_claim("late", 4)
    late["metadata"]["resourceVersion"] = "2"
    client = _Client([padded_claim("first")], [("ADDED", late)], stop)
    c = ClusterState(dra=True)
    seen: list[Obj] = []
    informers = dra_informers(InformerFactory(client, backoff_max_s=1.0), c)
    [claims] = [i for i in informers if i.kind == "resourceclaims"]
    claims.add_handler(lambda items: None, lambda k, o: seen.append(o))
    claims.reflector.run(stop)
    assert client.list_kw == [{"page_size": PAGE_SIZE["resourceclaims"], "transform": True}]
    assert PAGE_SIZE["resourceclaims"] <= 50
    assert len(seen) == 1 and KEPT in seen[0] and "spec" not in seen[0]
    # The informer's store keeps the same small form, indexed by namespace.
    kept = claims.by_index("namespace", late["metadata"]["namespace"])
    assert len(kept) == 2 and all(KEPT in o and "spec" not in o for o in kept)


def test_a_reflector_without_transform_lists_as_before() -> None:
    stop = threading.Event()
    client = _Client([{"metadata": {"name": "n"}}], [], stop)
    got: list[list[Obj]] = []
    Reflector(client, "nodes", "/api/v1/nodes", got.append, lambda k, o: None).run(stop)
    assert client.list_kw == [{"page_size": 500, "transform": False}]
    assert got == [[{"metadata": {"name": "n"}}]]
