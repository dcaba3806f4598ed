"""List + watch one kind into a handler, like client-go's reflector.

List, hand the items to `on_replace`, then watch from the list's resourceVersion and
hand each event to `on_event`. A 410 (version too old) relists at once; any other
failure waits out a jittered backoff and relists, so a restarted API server cannot be
hammered by a fleet of extenders. Readers never call the API: they read the store the
handlers maintain.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

from loguru import logger

from gpudaemon.errors import KubeError, KubeGoneError, KubeNotFoundError
from gpudaemon.kube.backoff import Backoff

Obj = dict[str, Any]


class ListWatchClient(Protocol):
    def list_items(
        self, path: str, query: Mapping[str, str] | None = None
    ) -> tuple[list[Obj], str]:
        """A Reflector with a `transform` or a `page_size` also passes those (keywords of
        KubeClient.list_items): a client that lists for one must take them."""
        ...

    def watch(
        self,
        path: str,
        resource_version: str,
        timeout_s: float = 300.0,
        query: Mapping[str, str] | None = None,
    ) -> Iterator[tuple[str, Obj]]: ...

    def request(self, method: str, path: str, *, timeout_s: float | None = None) -> Obj:
        """One call (the pod verifier's single GET); KubeError on failure."""
        ...


class Reflector:
    """Keeps one collection mirrored; `synced` once the first list has landed."""

    def __init__(
        self,
        client: ListWatchClient,
        kind: str,
        path: str,
        on_replace: Callable[[list[Obj]], None],
        on_event: Callable[[str, Obj], None],
        *,
        query: Mapping[str, str] | None = None,
        watch_timeout_s: float = 300.0,
        backoff: Backoff | None = None,
        clock: Callable[[], float] = time.monotonic,
        rng: Callable[[], float] = random.random,
        optional: str = "",
        transform: Callable[[Obj], Obj] | None = None,
        page_size: int | None = None,
    ) -> None:
        self.client, self.kind, self.path = client, kind, path
        # client-go's TransformFunc: each listed item, page by page as it arrives, and
        # each watched object becomes what the handlers keep, so a kind whose objects
        # tenants write (ResourceClaims) costs what we keep, not what they wrote.
        # `page_size`: smaller list pages than the client's default, for such kinds.
        self.transform = transform
        self._list_kw: dict[str, Any] = {}
        if transform is not None:
            self._list_kw["transform"] = transform
        if page_size is not None:
            self._list_kw["page_size"] = page_size
        # Not "" : a kind some API servers do not serve (404), e.g. DeviceTaintRule before
        # 1.37. Such a server counts as "none of them" and synced, so the program gets
        # ready; the list is retried with backoff in case the API is turned on. The
        # text says why it may be missing, in the one log line.
        self.optional = optional
        self.rng = rng
        self.on_replace, self.on_event = on_replace, on_event
        self.query = dict(query or {})
        self.watch_timeout_s = watch_timeout_s
        self.backoff = backoff or Backoff(0.5, 30.0)
        self.clock = clock
        self.synced = threading.Event()
        self.last_sync_at: float | None = None  # last list or event, for the cache-age metric
        self.relists = 0
        # Objects a handler could not take (it raised): counted, logged once each, and
        # skipped, so one bad object neither fails a list nor ends a watch.
        self.handler_errors = 0
        self._logged_bad: set[str] = set()
        self._failing = False

    def run(self, stop: threading.Event) -> None:
        """Until `stop` is set. Never raises: errors are logged once per outage."""
        while not stop.is_set():
            try:
                rv = self._list()
                self._watch(rv, stop)
            except KubeGoneError:
                logger.debug("{} watch: resourceVersion too old, relisting", self.kind)
                self.relists += 1
                continue
            except KubeNotFoundError as e:
                if stop.is_set():
                    return
                if not self.optional:
                    self._failed(e, stop)
                    continue
                if not self._failing:  # one line per outage; the cache holds none
                    logger.warning(
                        "{}: not served by the API server ({}); treated as none, retrying",
                        self.kind,
                        self.optional,
                    )
                    self._replace([])
                    self.synced.set()
                self._failing = True
                stop.wait(self.backoff.next_delay())
            except KubeError as e:
                if stop.is_set():
                    return
                self._failed(e, stop)
            except Exception as e:  # a bug must not end the watch for good
                logger.exception("{} watch: unexpected error: {}", self.kind, e)
                stop.wait(self.backoff.next_delay())
                self.relists += 1

    def _failed(self, e: KubeError, stop: threading.Event) -> None:
        if not self._failing:
            logger.warning("{} watch failed, retrying with backoff: {}", self.kind, e)
        self._failing = True
        stop.wait(self.backoff.next_delay())
        self.relists += 1

    def _list(self) -> str:
        items, rv = self.client.list_items(self.path, self.query, **self._list_kw)
        self._replace(items)
        self.last_sync_at = self.clock()
        self.synced.set()
        if self._failing:
            logger.info("{} watch: connected again ({} objects)", self.kind, len(items))
        self._failing = False
        self.backoff.reset()
        return rv

    def _watch(self, rv: str, stop: threading.Event) -> None:
        while not stop.is_set():
            # Between one and two times the timeout, as client-go's reflector: 5,000
            # extenders' (or one extender's three) watches do not end and relist in step.
            timeout = self.watch_timeout_s * (1.0 + self.rng())
            for kind, obj in self.client.watch(self.path, rv, timeout, self.query):
                if stop.is_set():
                    return
                new_rv = str((obj.get("metadata") or {}).get("resourceVersion") or rv)
                if kind != "BOOKMARK":
                    self._deliver(kind, obj if self.transform is None else self.transform(obj))
                del obj  # not held while the next event is read
                rv = new_rv
                self.last_sync_at = self.clock()
            # The server ended the watch (timeoutSeconds): resume from the last version.

    def _replace(self, items: list[Obj]) -> None:
        """The list into `on_replace`; if that raises, an empty list and then one
        ADDED event per object, each on its own, so the objects the handler can take
        are all there and the cache is synced (a bad object is not retried forever
        with backoff, leaving the program never ready)."""
        try:
            self.on_replace(items)
            return
        except Exception as e:
            logger.warning("{} list: the handler failed ({}: {}); taking the {} objects"
                           " one by one", self.kind, type(e).__name__, e, len(items))  # fmt: skip
        self.on_replace([])
        for obj in items:
            self._deliver("ADDED", obj)

    def _deliver(self, kind: str, obj: Obj) -> None:
        self.deliver(kind, obj, self.on_event)

    def deliver(self, kind: str, obj: Obj, on_event: Callable[[str, Obj], None]) -> None:
        """`on_event(kind, obj)`; if it raises, counted and logged once per object (a
        shared informer hands each of its handlers' events through here)."""
        try:
            on_event(kind, obj)
        except Exception as e:
            self.handler_errors += 1
            name = _name(obj)
            if name not in self._logged_bad:
                if len(self._logged_bad) >= 10_000:  # bounded: a flood of bad objects
                    self._logged_bad.clear()
                self._logged_bad.add(name)
                logger.opt(exception=e).error(
                    "{} watch: skipped {} (the handler raised {}); logged once per object",
                    self.kind, name, type(e).__name__)  # fmt: skip


def _name(obj: object) -> str:
    try:
        meta = obj.get("metadata") or {}  # type: ignore[attr-defined]
        ns, name = meta.get("namespace"), meta.get("name")
        name = name[:300] if isinstance(name, str) else f"({type(name).__name__} name)"
        return f"{ns[:100]}/{name}" if isinstance(ns, str) and ns else name
    except Exception:
        return "(an object without metadata)"
