"""The agent's watch of its own Node (issue 28 item 8): a re-created Node, our labels or
condition removed under us, are written again by the next kube-retry (a second), not
at the next Lease renewal; while the watch is live the heartbeat reads nothing. The
watch's own loop (list with a field selector, events, 410, failures) runs against a
scripted client here; against the real API server in tests/integration/kube/test_recreate.py.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from types import SimpleNamespace
from typing import Any

from gpudaemon.agent.nodewatch import NodeWatch, resource_version
from gpudaemon.errors import KubeGoneError, KubeNotFoundError, KubeUnavailableError
from gpudaemon.kube.backoff import Backoff
from tests.unit.test_kube import P, ls
from tests.unit.test_node_recreate import Recreatable, recreatable_sink


def view(fake: Recreatable, rv: int | None = None) -> dict[str, Any]:
    """The Node as a watch event would carry it (not counted as a read)."""
    node = fake.get_node("n1")
    fake.calls.pop()
    if rv is not None:
        node["metadata"]["resourceVersion"] = str(rv)
    return node


def watched_sink() -> tuple[Any, Recreatable, Any]:
    sink, fake, clock = recreatable_sink()
    sink.watch = SimpleNamespace(live=True, stop=lambda: None)
    assert sink.apply(ls()) is True
    sink.observe(view(fake))
    fake.calls.clear()
    return sink, fake, clock


def test_a_recreated_node_is_relabelled_by_the_next_kube_retry(
    lines: list[tuple[str, str]],
) -> None:
    sink, fake, clock = watched_sink()
    leases = len(fake.leases)
    fake.recreate("u-2")
    sink.observe(view(fake))  # ADDED, a new UID: no heartbeat needed
    clock.t += 1
    assert sink.retry() is True
    assert fake.labels[P + "gpu.count"] == "8"
    assert fake.leases[-1]["owner"]["uid"] == "u-2" and len(fake.leases) > leases
    assert sum("re-created (uid u-1 -> u-2)" in m for _, m in lines) == 1


def test_a_node_back_after_a_long_absence_skips_the_backoff_it_built_up() -> None:
    sink, fake, clock = watched_sink()
    fake.missing = True
    sink.observe(None)  # DELETED
    clock.t += 120
    assert sink.heartbeat() is False  # not vouched for; kube-retry takes over
    for second in range(1, 601):  # ten minutes of 404s: the backoff reaches its 60 s cap
        clock.t += 1
        try:
            sink.retry()
        except KubeNotFoundError:
            if second > 300:
                break
    assert sink._retry_at >= clock.t + 30  # just failed: backing off half a minute or more
    fake.recreate("u-2")
    sink.observe(view(fake))
    clock.t += 1
    assert sink.retry() is True
    assert fake.labels[P + "gpu.count"] == "8" and fake.leases[-1]["owner"]["uid"] == "u-2"


def test_labels_removed_under_us_are_written_again_at_once_then_with_backoff() -> None:
    sink, fake, clock = watched_sink()
    fake.labels.pop(P + "gpu.count")
    sink.observe(view(fake))
    clock.t += 1
    assert sink.retry() is True and fake.labels[P + "gpu.count"] == "8"
    # Someone keeps removing them: the repairs are spaced out, not one per removal.
    repairs = 0
    for _ in range(60):
        fake.labels.pop(P + "gpu.count", None)
        sink.observe(view(fake))
        clock.t += 1
        repairs += sink.retry()
    assert 3 <= repairs <= 8


def test_our_condition_removed_under_us_is_written_again() -> None:
    sink, fake, clock = watched_sink()
    assert "GPUHealthy" in fake.conditions
    fake.conditions.clear()
    fake.rv += 1
    sink.observe(view(fake))
    clock.t += 1
    assert sink.retry() is True
    assert fake.conditions["GPUHealthy"]["status"] == "True"
    assert "get" not in fake.calls and "uid" not in fake.calls  # the view was enough


def test_a_view_older_than_our_own_write_is_not_taken_for_an_edit() -> None:
    sink, fake, clock = watched_sink()
    sink._known_rv = 50  # our last write's version
    stale = view(fake, rv=40)
    stale["metadata"]["labels"].pop(P + "gpu.count")
    sink.observe(stale)
    clock.t += 1
    assert sink.retry() is False and fake.calls == []


def test_with_a_live_watch_an_hour_of_heartbeats_reads_the_node_never() -> None:
    sink, fake, clock = watched_sink()
    for second in range(1, 3601):
        clock.t += 1
        sink.retry()
        if second % 30 == 0:
            assert sink.apply(ls()) is False
        if second % 120 == 0:
            assert sink.heartbeat() is True
    assert fake.calls.count("get") + fake.calls.count("uid") == 0
    assert fake.calls.count("lease") == 30 and "apply" not in fake.calls


def test_without_a_live_watch_the_heartbeat_reads_as_before() -> None:
    sink, fake, clock = watched_sink()
    sink.watch.live = False  # the watch is failing: the read is the fallback
    clock.t += 120
    assert sink.heartbeat() is True
    assert fake.calls == ["uid", "lease"]


def test_a_deleted_node_is_not_vouched_for() -> None:
    sink, fake, clock = watched_sink()
    sink.observe(None)
    leases = len(fake.leases)
    clock.t += 120
    assert sink.heartbeat() is False and len(fake.leases) == leases


# -- the watch loop ------------------------------------------------------------------


class Scripted:
    """Lists and watches from scripts; records the queries."""

    def __init__(self, lists: list[Any], watches: list[list[Any]], stop: threading.Event):
        self.lists, self.watches, self.stop = lists, watches, stop
        self.queries: list[tuple[str, dict[str, str]]] = []

    def list_items(self, path: str, query: Mapping[str, str] | None = None) -> Any:
        self.queries.append(("list", dict(query or {})))
        step = self.lists.pop(0) if self.lists else None
        if step is None:
            self.stop.set()
            raise KubeUnavailableError("script over")
        if isinstance(step, Exception):
            raise step
        return step

    def watch(
        self, path: str, rv: str, timeout_s: float = 300.0, query: Any = None
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        self.queries.append(("watch", dict(query or {})))
        for step in self.watches.pop(0) if self.watches else []:
            if isinstance(step, Exception):
                raise step
            yield step
        if not self.watches and not self.lists:
            self.stop.set()


def node(uid: str, rv: int) -> dict[str, Any]:
    return {"metadata": {"name": "n1", "uid": uid, "resourceVersion": str(rv)}}


def test_the_watch_lists_and_watches_only_its_node_and_reports_every_view() -> None:
    stop = threading.Event()
    client = Scripted(
        [([node("u-1", 5)], "5"), ([node("u-2", 9)], "9")],
        [
            [("MODIFIED", node("u-1", 6)), ("DELETED", node("u-1", 7))],
            [KubeGoneError("too old", 410)],
            [("BOOKMARK", node("", 10))],
        ],
        stop,
    )
    seen: list[Any] = []
    w = NodeWatch(client, "n1", seen.append, backoff=Backoff(0.001, 0.001))  # type: ignore[arg-type]
    w.run(stop)
    uids = [(n or {}).get("metadata", {}).get("uid") for n in seen]
    assert uids == ["u-1", "u-1", None, "u-2"]  # list, MODIFIED, DELETED, relist on 410
    assert all(q.get("fieldSelector") == "metadata.name=n1" for _, q in client.queries)
    assert [k for k, _ in client.queries][:4] == ["list", "watch", "watch", "list"]


def test_the_watch_is_live_only_between_a_good_list_and_a_failure() -> None:
    stop = threading.Event()
    states: list[bool] = []
    client = Scripted(
        [KubeUnavailableError("refused"), ([node("u-1", 5)], "5")],
        [[KubeUnavailableError("connection reset")]],
        stop,
    )
    w: NodeWatch

    def record(_: Any) -> None:
        states.append(w.live)

    w = NodeWatch(client, "n1", record, backoff=Backoff(0.001, 0.001))  # type: ignore[arg-type]
    assert w.live is False
    w.run(stop)
    assert states == [True] and w.live is False


def test_resource_versions_compare_as_numbers_and_junk_is_never_old() -> None:
    assert resource_version(node("u", 10)) == 10
    assert resource_version({"metadata": {"resourceVersion": "abc"}}) is None
    assert resource_version(None) is None
