"""The agent's watch of its own Node, as kubelet has one: list + watch with
`fieldSelector=metadata.name=<node>`, so a Node deleted and re-created under the agent
(a replaced machine, a kubelet registering again), or our labels, annotation or
condition removed by someone, is seen within a second instead of at the next Lease
renewal. A watch costs no reads in steady state: one long request (5-10 min, then
resumed from the last resourceVersion), a relist only after a failure or a 410.

It is an informer of the factory type the extender and the rebalancer use
(kube/informers.py: list, watch from the list's version, relist on 410, jittered backoff
on other errors), and hands every view of the Node to a callback: the Node, or None
when it is gone. While the watch is live its last view stands in for
the Lease heartbeat's read of the Node (`NodeLabelSink.heartbeat`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from gpudaemon.errors import KubeError, KubeGoneError
from gpudaemon.kube.backoff import Backoff
from gpudaemon.kube.client import KubeClient
from gpudaemon.kube.informer import Obj
from gpudaemon.kube.informers import InformerFactory

# Between one and two times this (the Reflector's jitter): one request per 5-10 min.
WATCH_TIMEOUT_S = 300.0
# After a failure the heartbeat reads the Node instead, so the watch can retry slowly:
# a refused list (an old ClusterRole without `watch`) costs at most one read per 5 min.
BACKOFF_CAP_S = 300.0


class _Tracked:
    """The client as the Reflector sees it, noting whether the last list or watch
    worked: the watch is "live" only between a good list and the next failure."""

    def __init__(self, client: KubeClient, watch: NodeWatch) -> None:
        self.client, self.w = client, watch

    def list_items(
        self, path: str, query: Mapping[str, str] | None = None
    ) -> tuple[list[Obj], str]:
        try:
            out = self.client.list_items(path, query)
        except KubeError:
            self.w.live = False
            raise
        self.w.live = True
        return out

    def watch(
        self,
        path: str,
        resource_version: str,
        timeout_s: float = WATCH_TIMEOUT_S,
        query: Mapping[str, str] | None = None,
    ) -> Iterator[tuple[str, Obj]]:
        try:
            yield from self.client.watch(path, resource_version, timeout_s, query)
        except KubeGoneError:
            raise  # relisted at once: not an outage
        except KubeError:
            self.w.live = False
            raise

    def request(self, method: str, path: str, *, timeout_s: float | None = None) -> Obj:
        return self.client.request(method, path, timeout_s=timeout_s)


class NodeWatch:
    """One daemon thread keeping `on_node` told of the Node named `node`."""

    def __init__(
        self,
        client: KubeClient,
        node: str,
        on_node: Callable[[Obj | None], None],
        *,
        timeout_s: float = WATCH_TIMEOUT_S,
        backoff: Backoff | None = None,
    ) -> None:
        self.node = node
        self.on_node = on_node
        self.live = False
        # From the factory type the extender and the rebalancer use: one list + watch,
        # its handlers fanned out; no store (the handlers keep what they read).
        self.informers = InformerFactory(
            _Tracked(client, self), backoff_max_s=BACKOFF_CAP_S, watch_timeout_s=timeout_s
        )
        self.informer = self.informers.informer(
            f"node {node}",
            "/api/v1/nodes",
            {"fieldSelector": f"metadata.name={node}"},
            backoff=backoff or Backoff(1.0, BACKOFF_CAP_S),
            store=False,
        )
        self.informer.add_handler(self._replace, self._event)
        self.reflector = self.informer.reflector
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _replace(self, items: list[Obj]) -> None:
        mine = [i for i in items if (i.get("metadata") or {}).get("name") == self.node]
        self.on_node(mine[0] if mine else None)

    def _event(self, kind: str, obj: Obj) -> None:
        if (obj.get("metadata") or {}).get("name") != self.node:
            return
        self.on_node(None if kind == "DELETED" else obj)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self.reflector.run, args=(self._stop,), name="node-watch", daemon=True
            )
            self._thread.start()

    def stop(self) -> None:
        """Ends the loop; a watch blocked in a read ends with the process (daemon)."""
        self.live = False
        self._stop.set()

    def run(self, stop: threading.Event) -> None:
        """In the caller's thread, until `stop` (tests)."""
        self._stop = stop
        self.reflector.run(stop)


def resource_version(obj: Mapping[str, Any] | None) -> int | None:
    """The object's resourceVersion as a number, None when it is not one. etcd's are
    revisions, comparable since KEP-5504; an unparsable one is never treated as old."""
    rv = ((obj or {}).get("metadata") or {}).get("resourceVersion")
    try:
        return int(rv) if isinstance(rv, str) and rv else None
    except ValueError:
        return None
