"""The reflector lists, watches from the list's version, relists at once on 410 and
after a backoff on other errors, and never lets a failure end the loop."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from typing import Any

import pytest

from gpudaemon.errors import KubeGoneError, KubeNotFoundError, KubeUnavailableError
from gpudaemon.kube.backoff import Backoff
from gpudaemon.kube.informer import Reflector


class ScriptedClient:
    """Each list returns the next scripted list; each watch plays the next script."""

    def __init__(
        self,
        lists: list[tuple[list[dict[str, Any]], str]],
        watches: list[list[Any]],
        stop: threading.Event,
    ) -> None:
        self.lists, self.watches, self.stop = lists, watches, stop
        self.calls: list[tuple[str, str]] = []

    def list_items(
        self, path: str, query: Mapping[str, str] | None = None
    ) -> tuple[list[dict[str, Any]], str]:
        if not self.lists:
            self.stop.set()
            raise KubeUnavailableError("script over")
        items, rv = self.lists.pop(0)
        self.calls.append(("list", rv))
        return items, rv

    def watch(
        self,
        path: str,
        resource_version: str,
        timeout_s: float = 300.0,
        query: Mapping[str, str] | None = None,
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        self.calls.append(("watch", resource_version))
        if not self.watches:
            self.stop.set()
            return
        for step in self.watches.pop(0):
            if isinstance(step, Exception):
                raise step
            yield step


def obj(name: str, rv: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "resourceVersion": rv}}


def run(client: ScriptedClient, stop: threading.Event) -> tuple[list[Any], list[float]]:
    seen: list[Any] = []
    delays: list[float] = []
    r = Reflector(
        client,
        "nodes",
        "/api/v1/nodes",
        lambda items: seen.append(("replace", [i["metadata"]["name"] for i in items])),
        lambda k, o: seen.append((k, o["metadata"]["name"])),
        backoff=Backoff(1, 8, rng=lambda: 1.0),
    )
    orig_wait = stop.wait

    def fake_wait(t: float | None = None) -> bool:
        if t:
            delays.append(t)
        return orig_wait(0)

    stop.wait = fake_wait  # type: ignore[method-assign]
    r.run(stop)
    assert r.synced.is_set()
    return seen, delays


def test_list_then_watch_from_its_version_and_resume_after_the_server_ends_a_watch() -> None:
    stop = threading.Event()
    client = ScriptedClient(
        [([obj("a", "1")], "10")],
        [[("ADDED", obj("b", "11")), ("BOOKMARK", obj("", "15"))], [("DELETED", obj("a", "16"))]],
        stop,
    )
    seen, delays = run(client, stop)
    assert seen == [("replace", ["a"]), ("ADDED", "b"), ("DELETED", "a")]
    # the second watch resumes from the bookmark's version, without a relist
    assert client.calls[:3] == [("list", "10"), ("watch", "10"), ("watch", "15")]
    assert not delays


def test_410_relists_at_once_and_other_errors_back_off() -> None:
    stop = threading.Event()
    client = ScriptedClient(
        [([obj("a", "1")], "10"), ([obj("a", "1"), obj("c", "30")], "30"), ([], "40")],
        [
            [("ADDED", obj("b", "11")), KubeGoneError("too old", 410)],
            [KubeUnavailableError("reset")],
            [],
        ],
        stop,
    )
    seen, delays = run(client, stop)
    assert ("replace", ["a", "c"]) in seen and ("replace", []) in seen
    assert [c for c in client.calls if c[0] == "list"] == [
        ("list", "10"),
        ("list", "30"),
        ("list", "40"),
    ]
    # only the unavailable error waited, with the backoff's delay (rng=1: the full delay)
    assert delays[0] == 1.0


def test_watch_timeouts_are_spread_between_one_and_two_times_the_setting() -> None:
    """client-go's reflector spreads its watch timeouts so that many watches do not end
    (and a fleet of extenders relist) in step (issue 23)."""
    first: list[float] = []
    for r in (0.0, 0.5, 0.999):
        seen: list[float] = []
        stop = threading.Event()

        class Recording(ScriptedClient):
            def watch(self, path: str, rv: str, timeout_s: float = 300.0, query: Any = None) -> Any:
                seen.append(timeout_s)  # noqa: B023 - read before the loop moves on
                return super().watch(path, rv, timeout_s, query)

        client = Recording(lists=[([], "1")], watches=[[]], stop=stop)
        Reflector(client, "nodes", "/api/v1/nodes", lambda i: None, lambda k, o: None,
                  watch_timeout_s=300, rng=lambda r=r: r).run(stop)  # fmt: skip
        first.append(seen[0])
    assert first == [300.0, 450.0, pytest.approx(599.7)]


def test_lists_come_in_pages_and_the_last_page_gives_the_version() -> None:
    from gpudaemon.kube.client import KubeClient

    pages = {
        "": {"items": [{"n": 1}, {"n": 2}], "metadata": {"continue": "t1", "resourceVersion": "9"}},
        "t1": {"items": [{"n": 3}], "metadata": {"resourceVersion": "9"}},
    }
    asked: list[dict[str, str]] = []

    def request(method: str, path: str, query: Any = None, **kw: Any) -> Any:
        asked.append(dict(query))
        return pages[query.get("continue", "")]

    client = KubeClient.__new__(KubeClient)
    client.request = request  # type: ignore[method-assign]
    items, rv = client.list_items("/api/v1/nodes", {"fieldSelector": "x"}, page_size=2)
    assert [i["n"] for i in items] == [1, 2, 3] and rv == "9"
    assert asked == [
        {"fieldSelector": "x", "limit": "2"},
        {"fieldSelector": "x", "limit": "2", "continue": "t1"},
    ]


class NotServed(ScriptedClient):
    """An API server without the kind: 404 on the first `missing` lists, then served."""

    def __init__(self, missing: int, stop: threading.Event) -> None:
        super().__init__([([obj("r1", "5")], "5")], [], stop)
        self.missing = missing

    def list_items(
        self, path: str, query: Mapping[str, str] | None = None
    ) -> tuple[list[dict[str, Any]], str]:
        if self.missing:
            self.missing -= 1
            raise KubeNotFoundError("GET /apis/x: HTTP 404: the server could not find it", 404)
        return super().list_items(path, query)


@pytest.mark.parametrize("optional", ["", "served from 1.37"])
def test_a_kind_the_server_does_not_serve_is_none_and_synced_only_when_optional(
    optional: str,
) -> None:
    """DeviceTaintRule is not served before 1.37: an optional kind must not keep the
    extender unready; a required one stays unsynced until it is served."""
    stop = threading.Event()
    client = NotServed(3, stop)
    seen: list[Any] = []
    synced_while_missing: list[bool] = []
    r = Reflector(
        client,
        "devicetaintrules",
        "/apis/x",
        lambda items: seen.append([i["metadata"]["name"] for i in items]),
        lambda k, o: None,
        backoff=Backoff(1, 8, rng=lambda: 1.0),
        optional=optional,
    )

    def fake_wait(t: float | None = None) -> bool:
        if client.missing:
            synced_while_missing.append(r.synced.is_set())
        return stop.is_set()

    stop.wait = fake_wait  # type: ignore[method-assign]
    r.run(stop)
    assert synced_while_missing and all(synced_while_missing) == bool(optional)
    # Once served, the real list replaces the empty one.
    assert seen == ([[], ["r1"]] if optional else [["r1"]])
