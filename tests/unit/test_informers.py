"""The shared informer factory (gpudaemon/kube/informers.py): one list + watch per
resource and selector however many parts of a program register, every handler sees the
list and each event in order, the store and its indexers follow adds, updates, deletes
and relists, a transform runs once per object, and a conflicting request is refused."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest

from gpudaemon.errors import KubeGoneError, KubeUnavailableError
from gpudaemon.kube.backoff import Backoff
from gpudaemon.kube.informers import (
    InformerFactory,
    by_claim,
    by_namespace,
    by_node,
    object_key,
)
from gpudaemon.kube.runner import Runner

Obj = dict[str, Any]


class ScriptedClient:
    """Each list returns the next scripted list (transformed as KubeClient does); each
    watch plays the next script; the end of the script stops the run."""

    def __init__(self, lists: list[list[Obj]], watches: list[list[Any]]) -> None:
        self.lists, self.watches = lists, watches
        self.stop = threading.Event()
        self.calls: list[tuple[str, str, dict[str, str]]] = []

    def list_items(
        self,
        path: str,
        query: Mapping[str, str] | None = None,
        transform: Callable[[Obj], Obj] | None = None,
        page_size: int | None = None,
    ) -> tuple[list[Obj], str]:
        self.calls.append(("list", path, dict(query or {})))
        if not self.lists:
            self.stop.set()
            raise KubeUnavailableError("script over")
        items = self.lists.pop(0)
        return [transform(o) if transform else o for o in items], str(len(self.lists))

    def watch(
        self,
        path: str,
        resource_version: str,
        timeout_s: float = 300.0,
        query: Mapping[str, str] | None = None,
    ) -> Iterator[tuple[str, Obj]]:
        self.calls.append(("watch", path, dict(query or {})))
        if not self.watches:
            self.stop.set()
            return
        for step in self.watches.pop(0):
            if isinstance(step, Exception):
                raise step
            yield step

    def request(self, method: str, path: str, *, timeout_s: float | None = None) -> Obj:
        raise AssertionError("informers never GET")


def pod(name: str, node: str = "", ns: str = "team-a", claims: tuple[str, ...] = ()) -> Obj:
    return {
        "metadata": {"name": name, "namespace": ns, "resourceVersion": "1"},
        "spec": {
            "nodeName": node,
            "resourceClaims": [{"name": c, "resourceClaimName": c} for c in claims],
        },
    }


def names(objs: list[Obj]) -> list[str]:
    return sorted(o["metadata"]["name"] for o in objs)


def run_all(factory: InformerFactory, client: ScriptedClient) -> None:
    for r in factory.reflectors:
        r.run(client.stop)


def test_two_registrations_share_one_list_and_watch_and_both_see_everything_in_order() -> None:
    client = ScriptedClient(
        [[pod("a", "n1")]],
        [[("ADDED", pod("b", "n2")), ("MODIFIED", pod("a", "n3")), ("DELETED", pod("b"))]],
    )
    factory = InformerFactory(client)
    sel = {"fieldSelector": "spec.nodeName!="}
    first = factory.informer("pods", "/api/v1/pods", sel)
    second = factory.informer("pods", "/api/v1/pods", dict(sel))
    assert first is second and len(factory.reflectors) == 1
    seen: dict[str, list[Any]] = {"one": [], "two": []}
    for log in seen.values():
        first.add_handler(
            lambda items, log=log: log.append(("replace", names(items))),  # type: ignore[misc]
            lambda k, o, log=log: log.append((k, o["metadata"]["name"])),  # type: ignore[misc]
        )
    run_all(factory, client)
    # One list, one watch (resumed once, when its script ended), both with the selector.
    assert client.calls == [("list", "/api/v1/pods", sel)] + [("watch", "/api/v1/pods", sel)] * 2
    expected = [("replace", ["a"]), ("ADDED", "b"), ("MODIFIED", "a"), ("DELETED", "b")]
    assert seen["one"][:4] == expected and seen["two"][:4] == expected


def test_another_selector_is_another_informer() -> None:
    factory = InformerFactory(ScriptedClient([], []))
    bound = factory.informer("pods", "/api/v1/pods", {"fieldSelector": "spec.nodeName!="})
    pending = factory.informer("pending", "/api/v1/pods", {"fieldSelector": "spec.nodeName="})
    assert bound is not pending
    assert [r.kind for r in factory.reflectors] == ["pods", "pending"]


@pytest.mark.parametrize(
    "change",
    [
        {"transform": lambda o: o},
        {"page_size": 10},
        {"store": False},
        {"optional": "not served before 1.37"},
        {"kind": "other"},
    ],
)
def test_asking_for_the_same_informer_in_another_form_is_refused(change: dict[str, Any]) -> None:
    factory = InformerFactory(ScriptedClient([], []))
    factory.informer("pods", "/api/v1/pods")
    args: dict[str, Any] = {"kind": "pods", "path": "/api/v1/pods", **change}
    with pytest.raises(ValueError, match="asked with"):
        factory.informer(**args)


def test_the_store_and_its_indexers_follow_adds_updates_deletes_and_a_relist() -> None:
    client = ScriptedClient(
        [
            [pod("a", "n1"), pod("b", "n1", ns="team-b", claims=("c1",))],
            [pod("z", "n9")],  # after the 410: everything else is gone
        ],
        [
            [
                ("ADDED", pod("c", "n2", claims=("c1", "c2"))),
                ("MODIFIED", pod("a", "n2")),  # moved: out of n1's entry
                ("DELETED", pod("b", "n1", ns="team-b")),
                KubeGoneError("too old"),
            ]
        ],
    )
    factory = InformerFactory(client)
    inf = factory.informer("pods", "/api/v1/pods")
    inf.add_indexer("node", by_node)
    inf.add_indexer("namespace", by_namespace)
    inf.add_indexer("claim", by_claim)
    snapshots: list[dict[str, list[str]]] = []

    def look(*_: Any) -> None:  # after the store: a handler reads what it was told
        snapshots.append({v: names(inf.by_index("node", v)) for v in ("n1", "n2", "n9")})

    inf.add_handler(look, look)
    inf.reflector.run(client.stop)
    assert snapshots[0] == {"n1": ["a", "b"], "n2": [], "n9": []}
    assert snapshots[1] == {"n1": ["a", "b"], "n2": ["c"], "n9": []}
    assert snapshots[2] == {"n1": ["b"], "n2": ["a", "c"], "n9": []}
    assert snapshots[3] == {"n1": [], "n2": ["a", "c"], "n9": []}
    assert snapshots[4] == {"n1": [], "n2": [], "n9": ["z"]}  # the relist replaced all
    assert inf.keys() == ["team-a/z"] and len(inf) == 1
    assert inf.by_index("namespace", "team-b") == [] and inf.by_index("claim", "team-a/c1") == []
    assert inf.get("team-a/z") is not None and inf.get("team-a/a") is None


def test_the_claim_index_between_the_watch_events() -> None:
    client = ScriptedClient(
        [[pod("b", "n1", ns="team-b", claims=("c1",))]],
        [[("ADDED", pod("c", "n2", claims=("c1", "c2")))]],
    )
    factory = InformerFactory(client)
    inf = factory.informer("pods", "/api/v1/pods")
    inf.add_indexer("claim", by_claim)
    inf.reflector.run(client.stop)
    assert names(inf.by_index("claim", "team-a/c1")) == ["c"]
    assert names(inf.by_index("claim", "team-b/c1")) == ["b"]
    assert names(inf.by_index("claim", "team-a/c2")) == ["c"]


def test_an_indexer_added_late_indexes_what_is_stored() -> None:
    client = ScriptedClient([[pod("a", "n1"), pod("b")]], [])
    inf = InformerFactory(client).informer("pods", "/api/v1/pods")
    inf.reflector.run(client.stop)
    inf.add_indexer("node", by_node)
    assert names(inf.by_index("node", "n1")) == ["a"] and inf.by_index("node", "") == []
    with pytest.raises(ValueError):
        inf.add_indexer("node", by_node)
    with pytest.raises(KeyError):
        inf.by_index("unknown", "x")


def test_a_transform_runs_once_per_object_however_many_handlers() -> None:
    calls: list[str] = []

    def keep(o: Obj) -> Obj:
        calls.append(o["metadata"]["name"])
        return {"metadata": o["metadata"], "kept": True}

    client = ScriptedClient([[pod("a")]], [[("ADDED", pod("b")), ("MODIFIED", pod("a"))]])
    factory = InformerFactory(client)
    inf = factory.informer("pods", "/api/v1/pods", transform=keep, page_size=10)
    got: list[Obj] = []
    for _ in range(3):
        inf.add_handler(got.extend, lambda k, o: got.append(o))
    inf.reflector.run(client.stop)
    assert calls == ["a", "b", "a"]
    assert len(got) == 9 and all(o.get("kept") for o in got)
    assert all(o.get("kept") for o in inf.items())


def test_a_failing_handler_does_not_cost_the_others_anything() -> None:
    client = ScriptedClient(
        [[pod("a"), pod("bad")]], [[("ADDED", pod("bad")), ("ADDED", pod("c"))]]
    )
    inf = InformerFactory(client).informer("pods", "/api/v1/pods")
    good: list[Any] = []
    picky: list[Any] = []

    def picky_replace(items: list[Obj]) -> None:
        if any(o["metadata"]["name"] == "bad" for o in items):
            raise ValueError("bad")
        picky.append(("replace", names(items)))

    def picky_event(kind: str, o: Obj) -> None:
        if o["metadata"]["name"] == "bad":
            raise ValueError("bad")
        picky.append((kind, o["metadata"]["name"]))

    inf.add_handler(lambda items: good.append(("replace", names(items))),
                    lambda k, o: good.append((k, o["metadata"]["name"])))  # fmt: skip
    inf.add_handler(picky_replace, picky_event)
    inf.reflector.run(client.stop)
    assert good[:3] == [("replace", ["a", "bad"]), ("ADDED", "bad"), ("ADDED", "c")]
    # The list one by one: empty, then each object it can take.
    assert picky[:3] == [("replace", []), ("ADDED", "a"), ("ADDED", "c")]
    assert inf.reflector.handler_errors == 2  # the listed bad one, the watched bad one
    assert inf.keys() == ["team-a/a", "team-a/bad", "team-a/c"]


def test_a_handler_added_after_the_first_list_is_refused() -> None:
    client = ScriptedClient([[pod("a")]], [])
    inf = InformerFactory(client).informer("pods", "/api/v1/pods")
    inf.reflector.run(client.stop)
    with pytest.raises(RuntimeError, match="after it started"):
        inf.add_handler(lambda items: None, lambda k, o: None)


def test_without_a_store_the_informer_only_fans_out() -> None:
    client = ScriptedClient([[pod("a")]], [[("ADDED", pod("b"))]])
    inf = InformerFactory(client).informer("nodes", "/api/v1/nodes", store=False)
    seen: list[Any] = []
    inf.add_handler(lambda items: seen.append(names(items)), lambda k, o: seen.append(k))
    inf.reflector.run(client.stop)
    assert seen[:2] == [["a"], "ADDED"] and len(inf) == 0
    with pytest.raises(RuntimeError, match="no store"):
        inf.items()
    with pytest.raises(RuntimeError, match="no store"):
        inf.add_indexer("node", by_node)


def test_the_runner_runs_the_factory_reflectors_and_is_ready_when_each_has_listed() -> None:
    client = ScriptedClient([[pod("a")], [pod("n")]], [])
    factory = InformerFactory(client, backoff_max_s=0.01)
    factory.informer("pods", "/api/v1/pods")
    factory.informer("nodes", "/api/v1/nodes", store=False)
    runner = Runner(factory.reflectors)
    assert runner.ready() == (False, "waiting for the first list of: pods, nodes")
    runner.start()
    assert runner.wait_synced(10) and runner.ready() == (True, "ok")
    runner.close()


@pytest.mark.parametrize(
    ("obj", "key"),
    [
        ({"metadata": {"name": "n1"}}, "n1"),
        ({"metadata": {"name": "p", "namespace": "ns"}}, "ns/p"),
        ({"metadata": {"name": ""}}, ""),
        ({"metadata": "junk"}, ""),
        ({}, ""),
    ],
)
def test_object_keys_as_client_go_makes_them(obj: Obj, key: str) -> None:
    assert object_key(obj) == key


def test_an_informer_may_bring_its_own_backoff_and_the_others_get_the_factory_cap() -> None:
    factory = InformerFactory(ScriptedClient([], []), backoff_max_s=7.0, watch_timeout_s=60.0)
    mine = Backoff(1.0, 300.0)
    own = factory.informer("node n1", "/api/v1/nodes", {"fieldSelector": "metadata.name=n1"},
                           backoff=mine)  # fmt: skip
    other = factory.informer("pods", "/api/v1/pods")
    assert own.reflector.backoff is mine and other.reflector.backoff.cap == 7.0
    assert own.reflector.watch_timeout_s == other.reflector.watch_timeout_s == 60.0
