"""Shared informers, like client-go's SharedInformerFactory: one list + watch per
resource and selector per process, its objects kept in one store with indexers, and
every event fanned out to the handlers registered for it.

A program builds one `InformerFactory` in its wiring and asks it for the informers it
needs; two parts of the program asking for the same (path, query) get the same
`Informer` and each add their handlers, so the API server sees one list and one watch.
The factory's reflectors go to `kube.runner.Runner`, which starts them and is ready
once every one has landed its first list.

Threading: each informer's reflector thread updates the store (under the informer's
lock) and then calls the handlers in the order they were registered, outside the lock;
readers of the store (`get`, `items`, `by_index`) take the lock and never call the API.
Handlers keep the signatures a `Reflector` has always called (`on_replace(items)`,
`on_event(kind, obj)`), so the existing caches plug in unchanged. A handler that raises
is that handler's problem only: the others still see the list or the event.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from loguru import logger

from gpudaemon.kube.backoff import Backoff
from gpudaemon.kube.informer import ListWatchClient, Obj, Reflector

OnReplace = Callable[[list[Obj]], None]
OnEvent = Callable[[str, Obj], None]
# client-go's IndexFunc: the values an object is found under (none: not indexed).
IndexFunc = Callable[[Obj], Iterable[str]]


def object_key(obj: Mapping[str, Any]) -> str:
    """client-go's MetaNamespaceKeyFunc: "namespace/name", or "name" for a cluster-scoped
    object; "" for an object without a readable name (fanned out, never stored)."""
    meta = obj.get("metadata")
    if not isinstance(meta, Mapping):
        return ""
    name, ns = meta.get("name"), meta.get("namespace")
    if not isinstance(name, str) or not name:
        return ""
    return f"{ns}/{name}" if isinstance(ns, str) and ns else name


def by_namespace(obj: Obj) -> list[str]:
    """Index function: the object's namespace (cluster-scoped objects are not indexed)."""
    ns = (obj.get("metadata") or {}).get("namespace")
    return [ns] if isinstance(ns, str) and ns else []


def by_node(obj: Obj) -> list[str]:
    """Index function: the node a pod is bound to (`spec.nodeName`)."""
    spec = obj.get("spec")
    node = spec.get("nodeName") if isinstance(spec, Mapping) else None
    return [node] if isinstance(node, str) and node else []


def by_claim(obj: Obj) -> list[str]:
    """Index function: "namespace/claim" for each ResourceClaim a pod names directly
    (`spec.resourceClaims[].resourceClaimName`) or was given from a template
    (`status.resourceClaimStatuses[].resourceClaimName`)."""
    ns = (obj.get("metadata") or {}).get("namespace")
    if not isinstance(ns, str):
        return []
    names: set[str] = set()
    for part, field in (("spec", "resourceClaims"), ("status", "resourceClaimStatuses")):
        section = obj.get(part)
        entries = section.get(field) if isinstance(section, Mapping) else None
        for entry in entries if isinstance(entries, list) else ():
            name = entry.get("resourceClaimName") if isinstance(entry, Mapping) else None
            if isinstance(name, str) and name:
                names.add(f"{ns}/{name}")
    return sorted(names)


class Informer:
    """One shared list + watch: its reflector, its store (unless `store=False`), its
    indexers and its handlers. Built by `InformerFactory.informer`, not directly.

    `store=False`: the informer only fans out. For kinds whose objects are large and
    whose handlers already keep what they need in their own form (Nodes: a Node object
    is tens of KB and `ClusterState` keeps a `NodeState`; bound pods: 50,000 of them in
    their kept form would be a second copy of what `ClusterState` has parsed), so 5,000
    Nodes are not held twice. Such an informer has no `get`, `items` or indexers.
    """

    def __init__(
        self,
        client: ListWatchClient,
        kind: str,
        path: str,
        *,
        query: Mapping[str, str] | None,
        transform: Callable[[Obj], Obj] | None,
        page_size: int | None,
        store: bool,
        optional: str,
        backoff: Backoff,
        clock: Callable[[], float],
        watch_timeout_s: float,
    ) -> None:
        self.kind, self.path = kind, path
        self.query = dict(query or {})
        self.transform, self.page_size = transform, page_size
        self.has_store, self.optional = store, optional
        self._lock = threading.Lock()
        self._items: dict[str, Obj] = {}
        self._indexers: dict[str, IndexFunc] = {}
        # index name -> value -> keys; and key -> its values per index, to undo on update
        self._indices: dict[str, dict[str, set[str]]] = {}
        self._values: dict[str, dict[str, list[str]]] = {}
        self._handlers: list[tuple[OnReplace, OnEvent]] = []
        self._delivered = False
        self.reflector = Reflector(
            client, kind, path, self._replace, self._event, query=self.query,
            watch_timeout_s=watch_timeout_s, backoff=backoff, clock=clock,
            optional=optional, transform=transform, page_size=page_size,
        )  # fmt: skip

    # -- registration (before the Runner starts) -------------------------------------

    def add_handler(self, on_replace: OnReplace, on_event: OnEvent) -> None:
        """Called with every list and every event, after the store has taken it, in the
        order handlers were added. Only before the first list: a handler added later
        would have missed it (client-go replays the store; nothing here needs that)."""
        with self._lock:
            if self._delivered:
                raise RuntimeError(f"{self.kind} informer: a handler added after it started")
            self._handlers.append((on_replace, on_event))

    def add_indexer(self, name: str, fn: IndexFunc) -> None:
        """Keeps `by_index(name, value)` for the values `fn` gives each stored object."""
        if not self.has_store:
            raise RuntimeError(f"{self.kind} informer has no store (store=False) to index")
        with self._lock:
            if name in self._indexers:
                raise ValueError(f"{self.kind} informer: indexer {name!r} added twice")
            self._indexers[name] = fn
            self._indices[name] = {}
            for key, obj in self._items.items():
                self._index_one(name, key, obj)

    # -- reads ----------------------------------------------------------------------

    def get(self, key: str) -> Obj | None:
        """The kept object under "namespace/name" (or "name"), None if absent."""
        self._need_store()
        with self._lock:
            return self._items.get(key)

    def items(self) -> list[Obj]:
        self._need_store()
        with self._lock:
            return list(self._items.values())

    def keys(self) -> list[str]:
        self._need_store()
        with self._lock:
            return list(self._items)

    def by_index(self, name: str, value: str) -> list[Obj]:
        """The stored objects whose indexer `name` gave `value`; KeyError for an
        indexer never added."""
        with self._lock:
            keys = self._indices[name].get(value, ())
            return [self._items[k] for k in sorted(keys)]

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def _need_store(self) -> None:
        if not self.has_store:
            raise RuntimeError(f"{self.kind} informer has no store (store=False)")

    # -- the reflector's side: store first, then the handlers --------------------------

    def _replace(self, items: list[Obj]) -> None:
        with self._lock:
            self._delivered = True
            handlers = list(self._handlers)
            if self.has_store:
                self._items.clear()
                self._values.clear()
                for index in self._indices.values():
                    index.clear()
                for obj in items:
                    self._put(obj)
        for on_replace, on_event in handlers:
            try:
                on_replace(items)
            except Exception as e:  # as a lone Reflector does: object by object
                logger.warning(
                    "{} list: a handler failed ({}: {}); taking the {} objects one by one",
                    self.kind, type(e).__name__, e, len(items),
                )  # fmt: skip
                try:
                    on_replace([])
                except Exception as e2:
                    logger.error("{} list: a handler failed on an empty list too ({}: {})",
                                 self.kind, type(e2).__name__, e2)  # fmt: skip
                    self.reflector.handler_errors += 1
                    continue
                for obj in items:
                    self.reflector.deliver("ADDED", obj, on_event)

    def _event(self, kind: str, obj: Obj) -> None:
        with self._lock:
            self._delivered = True
            handlers = list(self._handlers)
            if self.has_store:
                if kind == "DELETED":
                    self._drop(object_key(obj))
                else:
                    self._put(obj)
        for _, on_event in handlers:
            self.reflector.deliver(kind, obj, on_event)

    def _put(self, obj: Obj) -> None:
        key = object_key(obj)
        if not key:
            return
        self._drop(key)
        self._items[key] = obj
        for name in self._indexers:
            self._index_one(name, key, obj)

    def _drop(self, key: str) -> None:
        if self._items.pop(key, None) is None:
            return
        for name, values in self._values.pop(key, {}).items():
            index = self._indices[name]
            for value in values:
                keys = index.get(value)
                if keys is not None:
                    keys.discard(key)
                    if not keys:
                        del index[value]

    def _index_one(self, name: str, key: str, obj: Obj) -> None:
        try:
            values = [v for v in self._indexers[name](obj) if isinstance(v, str)]
        except Exception as e:  # a bad object is not indexed; it stays in the store
            logger.debug("{} informer: indexer {} refused {}: {}", self.kind, name, key, e)
            return
        if not values:
            return
        self._values.setdefault(key, {})[name] = values
        index = self._indices[name]
        for value in values:
            index.setdefault(value, set()).add(key)


class InformerFactory:
    """The informers of one program: one per (path, query), built on first request.

    Every informer gets its own `Backoff(0.5, backoff_max_s)` and the same clock and
    watch timeout. Asking again for a key returns the same informer; asking with another
    kind, transform, page size, store or `optional` is a programming error (ValueError):
    two parts of a program would otherwise each believe their own form was kept.
    """

    def __init__(
        self,
        client: ListWatchClient,
        *,
        backoff_max_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        watch_timeout_s: float = 300.0,
    ) -> None:
        self.client = client
        self.backoff_max_s, self.clock = backoff_max_s, clock
        self.watch_timeout_s = watch_timeout_s
        self._informers: dict[tuple[str, tuple[tuple[str, str], ...]], Informer] = {}

    def informer(
        self,
        kind: str,
        path: str,
        query: Mapping[str, str] | None = None,
        transform: Callable[[Obj], Obj] | None = None,
        page_size: int | None = None,
        *,
        store: bool = True,
        optional: str = "",
        backoff: Backoff | None = None,
    ) -> Informer:
        """The one informer for (path, query). `kind` names it in logs, readiness and
        metrics; `transform`, `page_size` and `optional` are the Reflector's; `backoff`
        replaces the factory's for this informer (used only when it is built)."""
        key = (path, tuple(sorted((query or {}).items())))
        found = self._informers.get(key)
        if found is None:
            found = Informer(
                self.client, kind, path, query=query, transform=transform,
                page_size=page_size, store=store, optional=optional,
                backoff=backoff or Backoff(0.5, self.backoff_max_s), clock=self.clock,
                watch_timeout_s=self.watch_timeout_s,
            )  # fmt: skip
            self._informers[key] = found
            return found
        asked = {"kind": kind, "transform": transform, "page_size": page_size,
                 "store": store, "optional": optional}  # fmt: skip
        for name, value in asked.items():
            if getattr(found, "has_store" if name == "store" else name) != value:
                raise ValueError(
                    f"informer for {path} {dict(key[1])}: asked with {name}={value!r},"
                    f" but it was built with another (one form per resource and selector)"
                )
        return found

    @property
    def informers(self) -> list[Informer]:
        """In the order they were first asked for."""
        return list(self._informers.values())

    @property
    def reflectors(self) -> list[Reflector]:
        """For `kube.runner.Runner`: one per informer."""
        return [i.reflector for i in self._informers.values()]
