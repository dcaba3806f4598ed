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

The store may hold another form than the handlers get: `keep` turns each delivered
object into what is stored (a program's parsed record of it; None: not stored), so a
consumer reads the store as its view instead of keeping a second copy. A consumer of
that form registers with `add_store_handler`: like client-go's OnAdd/OnUpdate/OnDelete
it gets the stored records, old and new, after the store has taken them, in the same
order as the other handlers and with the same isolation.
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
# A store handler's view of a relist: (the records before, the records now), by key.
OnReplaced = Callable[[Mapping[str, Any], Mapping[str, Any]], None]
# And of one event: (kind, key, the record before or None, the record now or None).
OnChanged = Callable[[str, str, Any, Any], None]
# client-go's KeyFunc: the key an object is stored under ("": fanned out, not stored).
KeyFunc = Callable[[Mapping[str, Any]], str]
# The stored form of a delivered object (None: not stored).
Keep = Callable[[Mapping[str, Any]], Any]
# client-go's IndexFunc: the values a stored record is found under (none: not indexed).
IndexFunc = Callable[[Any], Iterable[str]]


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


def uid_key(obj: Mapping[str, Any]) -> str:
    """A key by `metadata.uid`: for stores read by UID (the pod stores)."""
    meta = obj.get("metadata")
    uid = meta.get("uid") if isinstance(meta, Mapping) else None
    return uid if isinstance(uid, str) else ""


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


class Store:
    """client-go's thread-safe indexer: records by key, with indexers. `keep` makes the
    record of a delivered object (outside the lock; None, or an exception, leaves the
    object unstored), `key` its key. `replace` and `apply` return what changed, for
    the store handlers; the readers take the lock and never call the API."""

    def __init__(self, kind: str, keep: Keep | None = None, key: KeyFunc = object_key) -> None:
        self.kind, self.keep, self.key = kind, keep, key
        self._lock = threading.Lock()
        self._items: dict[str, Any] = {}
        self._indexers: dict[str, IndexFunc] = {}
        # index name -> value -> keys; and key -> its values per index, to undo on update
        self._indices: dict[str, dict[str, set[str]]] = {}
        self._values: dict[str, dict[str, list[str]]] = {}

    def key_of(self, obj: Mapping[str, Any]) -> str:
        """`key(obj)`; "" (not stored) for what has no key or is not an object."""
        try:
            return self.key(obj)
        except Exception:
            return ""

    def kept(self, obj: Mapping[str, Any]) -> Any:
        """The record stored for `obj` (None: not stored)."""
        if self.keep is None:
            return obj
        try:
            return self.keep(obj)
        except Exception as e:  # a bad object degrades that object only
            logger.debug("{} store: cannot keep {}: {}", self.kind, self.key_of(obj), e)
            return None

    def replace(self, items: Iterable[Mapping[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
        """The store becomes `items`; returns (the records before, the records now)."""
        new: dict[str, Any] = {}
        for obj in items:
            key = self.key_of(obj)
            rec = self.kept(obj) if key else None
            if rec is not None:
                new[key] = rec
        with self._lock:
            old, self._items = self._items, {}
            self._values.clear()
            for index in self._indices.values():
                index.clear()
            for key, rec in new.items():
                self._put(key, rec)
        return old, new

    def apply(self, kind: str, obj: Mapping[str, Any]) -> tuple[str, Any, Any]:
        """One watch event; returns (key, the record before, the record now)."""
        key = self.key_of(obj)
        rec = self.kept(obj) if key and kind != "DELETED" else None
        if not key:
            return key, None, None
        with self._lock:
            old = self._drop(key)
            if rec is not None:
                self._put(key, rec)
        return key, old, rec

    def add_indexer(self, name: str, fn: IndexFunc) -> None:
        """Keeps `by_index(name, value)` for the values `fn` gives each stored record."""
        with self._lock:
            if name in self._indexers:
                raise ValueError(f"{self.kind} store: indexer {name!r} added twice")
            self._indexers[name] = fn
            self._indices[name] = {}
            for key, rec in self._items.items():
                self._index_one(name, key, rec)

    def get(self, key: str) -> Any:
        """The record under `key`, None if absent."""
        with self._lock:
            return self._items.get(key)

    def items(self) -> list[Any]:
        with self._lock:
            return list(self._items.values())

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._items)

    def by_index(self, name: str, value: str) -> list[Any]:
        """The stored records whose indexer `name` gave `value`, in key order; KeyError
        for an indexer never added."""
        with self._lock:
            keys = self._indices[name].get(value, ())
            return [self._items[k] for k in sorted(keys)]

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def _put(self, key: str, rec: Any) -> None:
        self._items[key] = rec
        for name in self._indexers:
            self._index_one(name, key, rec)

    def _drop(self, key: str) -> Any:
        old = self._items.pop(key, None)
        if old is None:
            return None
        for name, values in self._values.pop(key, {}).items():
            index = self._indices[name]
            for value in values:
                keys = index.get(value)
                if keys is not None:
                    keys.discard(key)
                    if not keys:
                        del index[value]
        return old

    def _index_one(self, name: str, key: str, rec: Any) -> None:
        try:
            values = [v for v in self._indexers[name](rec) if isinstance(v, str)]
        except Exception as e:  # a bad record is not indexed; it stays in the store
            logger.debug("{} store: indexer {} refused {}: {}", self.kind, name, key, e)
            return
        if not values:
            return
        self._values.setdefault(key, {})[name] = values
        index = self._indices[name]
        for value in values:
            index.setdefault(value, set()).add(key)


class Informer:
    """One shared list + watch: its reflector, its store (unless `store=False`), its
    indexers and its handlers. Built by `InformerFactory.informer`, not directly.

    The store holds each object as `keep` makes it (the object itself without one), so
    a large kind (a Node is tens of KB) is held once, in the form its readers need.
    `store=False`: the informer only fans out (no `get`, `items`, indexers or store
    handlers), for kinds whose handlers keep nothing per object.
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
        keep: Keep | None,
        key: KeyFunc,
        optional: str,
        backoff: Backoff,
        clock: Callable[[], float],
        watch_timeout_s: float,
    ) -> None:
        self.kind, self.path = kind, path
        self.query = dict(query or {})
        self.transform, self.page_size = transform, page_size
        self.has_store, self.optional = store, optional
        self.keep, self.key = keep, key
        self.store = Store(kind, keep, key) if store else None
        self._lock = threading.Lock()
        # (on_replace, on_event) of a plain handler, or (on_replaced, on_changed) of a
        # store handler (the bool), in the order added.
        self._handlers: list[tuple[bool, Callable[..., None], Callable[..., None]]] = []
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
        self._add(False, on_replace, on_event)

    def add_store_handler(self, on_replaced: OnReplaced, on_changed: OnChanged) -> None:
        """Like `add_handler`, for a reader of the stored form: `on_replaced(old, new)`
        with the records before and after a relist, `on_changed(kind, key, old, new)`
        with the record before and after each event (None: there was none, or there is
        none now: deleted, or not kept)."""
        self._need_store()
        self._add(True, on_replaced, on_changed)

    def _add(self, stored: bool, a: Callable[..., None], b: Callable[..., None]) -> None:
        with self._lock:
            if self._delivered:
                raise RuntimeError(f"{self.kind} informer: a handler added after it started")
            self._handlers.append((stored, a, b))

    def add_indexer(self, name: str, fn: IndexFunc) -> None:
        """Keeps `by_index(name, value)` for the values `fn` gives each stored record."""
        self._need_store().add_indexer(name, fn)

    # -- reads ----------------------------------------------------------------------

    def get(self, key: str) -> Any:
        """The record under "namespace/name" (or "name", or the informer's own key),
        None if absent."""
        return self._need_store().get(key)

    def items(self) -> list[Any]:
        return self._need_store().items()

    def keys(self) -> list[str]:
        return self._need_store().keys()

    def by_index(self, name: str, value: str) -> list[Any]:
        """The stored records whose indexer `name` gave `value`; KeyError for an
        indexer never added."""
        return self._need_store().by_index(name, value)

    def __len__(self) -> int:
        return len(self.store) if self.store is not None else 0

    def _need_store(self) -> Store:
        if self.store is None:
            raise RuntimeError(f"{self.kind} informer has no store (store=False)")
        return self.store

    # -- the reflector's side: store first, then the handlers --------------------------

    def _replace(self, items: list[Obj]) -> None:
        with self._lock:
            self._delivered = True
            handlers = list(self._handlers)
        old, new = self.store.replace(items) if self.store is not None else ({}, {})
        for stored, on_replace, on_event in handlers:
            try:
                on_replace(old, new) if stored else on_replace(items)
            except Exception as e:  # as a lone Reflector does: object by object
                logger.warning(
                    "{} list: a handler failed ({}: {}); taking the {} objects one by one",
                    self.kind, type(e).__name__, e, len(items),
                )  # fmt: skip
                try:
                    on_replace(old, {}) if stored else on_replace([])
                except Exception as e2:
                    logger.error("{} list: a handler failed on an empty list too ({}: {})",
                                 self.kind, type(e2).__name__, e2)  # fmt: skip
                    self.reflector.handler_errors += 1
                    continue
                if not stored:
                    for obj in items:
                        self.reflector.deliver("ADDED", obj, on_event)
                    continue
                for obj in items:
                    key = self.store.key_of(obj) if self.store is not None else ""
                    if key in new:
                        self.reflector.deliver("ADDED", obj, _stored(on_event, key, None, new[key]))

    def _event(self, kind: str, obj: Obj) -> None:
        with self._lock:
            self._delivered = True
            handlers = list(self._handlers)
        key, old, new = self.store.apply(kind, obj) if self.store is not None else ("", None, None)
        for stored, _, on_event in handlers:
            self.reflector.deliver(
                kind, obj, _stored(on_event, key, old, new) if stored else on_event
            )


def _stored(on_changed: OnChanged, key: str, old: Any, new: Any) -> OnEvent:
    """A store handler's `on_changed`, called as the Reflector calls a plain handler
    (so its failures are counted and logged by object alike)."""
    return lambda kind, _obj: on_changed(kind, key, old, new)


class InformerFactory:
    """The informers of one program: one per (path, query), built on first request.

    Every informer gets its own `Backoff(0.5, backoff_max_s)` and the same clock and
    watch timeout. Asking again for a key returns the same informer; asking with another
    kind, transform, page size, store, keep, key or `optional` is a programming error (ValueError):
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
        keep: Keep | None = None,
        key: KeyFunc = object_key,
        optional: str = "",
        backoff: Backoff | None = None,
    ) -> Informer:
        """The one informer for (path, query). `kind` names it in logs, readiness and
        metrics; `transform`, `page_size` and `optional` are the Reflector's; `keep` and
        `key` the store's (`Store`); `backoff` replaces the factory's for this informer
        (used only when it is built)."""
        ident = (path, tuple(sorted((query or {}).items())))
        found = self._informers.get(ident)
        if found is None:
            found = Informer(
                self.client, kind, path, query=query, transform=transform,
                page_size=page_size, store=store, keep=keep, key=key, optional=optional,
                backoff=backoff or Backoff(0.5, self.backoff_max_s), clock=self.clock,
                watch_timeout_s=self.watch_timeout_s,
            )  # fmt: skip
            self._informers[ident] = found
            return found
        asked = {"kind": kind, "transform": transform, "page_size": page_size,
                 "store": store, "keep": keep, "key": key, "optional": optional}  # fmt: skip
        for name, value in asked.items():
            if getattr(found, "has_store" if name == "store" else name) != value:
                raise ValueError(
                    f"informer for {path} {dict(ident[1])}: asked with {name}={value!r},"
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
