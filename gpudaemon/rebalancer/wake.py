"""What wakes the leader between its regular passes: a Node whose `gpus` annotation
now shows a GPU needing a drain that our last view of the Node did not, so its drain
starts when the verdict arrives rather than up to rebalance.interval_s later. (The
other wake, a sick GPU's grace running out, is `LeaseState.grace_left`.)"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Any

from gpudaemon.errors import BadValueError
from gpudaemon.labels.annotations import decode_gpus
from gpudaemon.rebalancer.drain import drain_action

Obj = Mapping[str, Any]
NONE: frozenset[str] = frozenset()


class SickWatch:
    """Fed the Node watch's events after `ClusterState` has the Node; sets `wake` when
    one newly shows a GPU needing a drain. Per node it keeps only the annotation text
    last seen and which GPUs it said were sick, so the hundreds of Node updates a
    second of a big fleet (heartbeats, other labels) cost a dict lookup and a string
    compare, and only a changed annotation is decoded. Called from the nodes watch's
    thread only: no lock."""

    def __init__(self, key: str, wake: threading.Event) -> None:
        self.key, self.wake = key, wake
        self._seen: dict[str, tuple[str, frozenset[str]]] = {}  # node -> (text, sick)

    def node_event(self, kind: str, obj: Obj) -> None:
        try:
            meta = obj.get("metadata") or {}
            name = str(meta.get("name", ""))
            if kind == "DELETED":
                self._seen.pop(name, None)
                return
            text = (meta.get("annotations") or {}).get(self.key)
        except (AttributeError, TypeError):  # not a Node object: ClusterState says so
            return
        if self._observe(name, text if isinstance(text, str) else ""):
            self.wake.set()

    def replace(self, items: Iterable[Obj]) -> None:
        """A relist: the same, over the whole list; nodes not in it are forgotten."""
        old, self._seen = self._seen, {}
        woke = False
        for obj in items:
            try:
                meta = obj.get("metadata") or {}
                name = str(meta.get("name", ""))
                text = (meta.get("annotations") or {}).get(self.key)
            except (AttributeError, TypeError):
                continue
            if name in old:
                self._seen[name] = old[name]
            woke = self._observe(name, text if isinstance(text, str) else "") or woke
        if woke:
            self.wake.set()

    def _observe(self, name: str, text: str) -> bool:
        """Remember the node's annotation; True when it adds a GPU needing a drain."""
        last = self._seen.get(name)
        if last is not None and last[0] == text:
            return False
        sick = sick_uuids(text)
        self._seen[name] = (text, sick)
        return not sick <= (last[1] if last is not None else NONE)


def sick_uuids(text: str) -> frozenset[str]:
    """The GPUs (by UUID, else "#index") the annotation says need a drain; none for an
    unreadable one (ClusterState keeps no view of that node: nothing is drained)."""
    try:
        gpus = decode_gpus(text or "[]")
    except BadValueError:
        return NONE
    return frozenset(g.uuid or f"#{g.index}" for g in gpus if drain_action(g))
