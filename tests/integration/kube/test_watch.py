"""KubeClient list + watch against the real API server: the stream a watch-based reader
(the extender's informer) builds on. The 410 path (HTTP 410 and an ERROR event with
code 410) is pinned in tests/unit/test_kube.py: this server's watch cache still holds
every version since it started, so it cannot be made to answer 410 here."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import pytest

from tests.integration.kube.controlplane import ControlPlane

pytestmark = pytest.mark.integration


def test_list_then_watch_sees_added_and_modified_in_order(control_plane: ControlPlane) -> None:
    client = control_plane.as_agent()  # the agent's RBAC: nodes get/list/watch
    items, rv = client.list_items("/api/v1/nodes")
    assert rv and all(i.get("metadata", {}).get("name") for i in items)
    name = f"watch-{uuid.uuid4().hex[:8]}"
    events: list[tuple[str, dict[str, Any]]] = []

    def watch() -> None:
        for kind, obj in client.watch("/api/v1/nodes", rv, timeout_s=20):
            if obj.get("metadata", {}).get("name") == name:
                events.append((kind, obj))
                if kind == "MODIFIED":
                    return

    t = threading.Thread(target=watch)
    t.start()
    control_plane.create_node(name, {"team": "a"})
    control_plane.admin.request(
        "PATCH",
        f"/api/v1/nodes/{name}",
        body={"metadata": {"labels": {"team": "b"}}},
        content_type="application/merge-patch+json",
    )
    t.join(30)
    client.close()
    assert not t.is_alive()
    assert [k for k, _ in events] == ["ADDED", "MODIFIED"]
    assert events[1][1]["metadata"]["labels"]["team"] == "b"
