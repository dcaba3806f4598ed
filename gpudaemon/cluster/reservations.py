"""The room the rebalancer keeps for a pending pod it evicted others for, and the only
place the extender learns of it: the rebalancer leader's own Lease.

A reservation is (pod UID, node, until). The leader writes its live ones, as JSON, in
the annotation `gpudaemon.io/reservations` of its Lease `gpudaemon-rebalancer` (in
`kubernetes.lease_namespace`), before it evicts. Nothing else is trusted: the pod
annotations `gpudaemon.io/reserved-node` / `-until` are a mirror for people, and any
tenant can write those on their own pods.

A reservation has force only while
- the Lease is held by our rules (`kube/lease.py` `lease_held_until`): a holder is
  named, `renewTime + leaseDurationSeconds` is ahead, the renewTime is not more than
  `MAX_CLOCK_SKEW_S` ahead of our clock and the duration not over `MAX_LEADER_LEASE_S`
  (a rebalancer that lost or released the lead keeps nothing, nor does a forged Lease);
- its own `until` is ahead, and not past now + `MAX_RESERVE_S` (+ clock skew) when
  read: an entry further out is ignored, as no rebalancer writes one;
- its pod is still pending (unbound, not deleted) in the extender's `PendingPods`.

The value is read defensively: bounded in size and entries, every field typed; any bad
value means "no reservations" (counted, logged once), never an exception. The index is
by node, so a /filter with none costs one check, and with some, only the ones on the
nodes it judges.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import orjson
from loguru import logger
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gpudaemon.config import DNS1123_SUBDOMAIN
from gpudaemon.kube.lease import MAX_CLOCK_SKEW_S, lease_held_until
from gpudaemon.logsetup import LogLimiter

REBALANCER_LEASE = "gpudaemon-rebalancer"
RESERVATIONS_ANNOTATION = "gpudaemon.io/reservations"
# The human-readable mirror the rebalancer writes on the pending pod: never read back.
RESERVED_NODE_ANNOTATION = "gpudaemon.io/reserved-node"
RESERVED_UNTIL_ANNOTATION = "gpudaemon.io/reserved-until"

MAX_RESERVE_S = 600.0  # the longest any reservation lasts (config caps reserve_s too)
MAX_RESERVATIONS = 256  # entries in the annotation (config caps max_reservations lower)
MAX_TEXT_BYTES = 64 << 10  # 256 entries of ~200 bytes each, with room to spare
_MAX_UID = 128
_MAX_NAME = 253
_MAX_PRIORITY = 2**31  # int32, as spec.priority


@dataclass(frozen=True, slots=True)
class Reservation:
    uid: str
    pod: str  # "namespace/name", for reasons and people
    node: str
    gpus: int
    priority: int
    until: float  # wall-clock seconds


def encode(items: Iterable[Reservation]) -> str:
    """The annotation's text (the rebalancer writes it; `decode` reads it)."""
    return orjson.dumps(
        [
            {
                "uid": r.uid,
                "pod": r.pod,
                "node": r.node,
                "gpus": r.gpus,
                "priority": r.priority,
                "until": round(r.until, 3),
            }
            for r in items
        ]
    ).decode()


def _int(v: Any, lo: int, hi: int) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise ValueError(f"{v!r} is not a whole number in [{lo}, {hi}]")
    return v


def _str(v: Any, limit: int) -> str:
    if not isinstance(v, str) or not v or len(v) > limit:
        raise ValueError(f"expected a string of 1 to {limit} characters, got {type(v).__name__}")
    return v


def decode(text: object, max_until: float = math.inf) -> list[Reservation]:
    """The reservations in `text`; ValueError (with why) for anything else than what
    `encode` writes. An entry whose `until` is past `max_until` is ignored: no
    rebalancer writes one (it reserves for at most `MAX_RESERVE_S`)."""
    if not isinstance(text, str):
        raise ValueError(f"not a string but {type(text).__name__}")
    if len(text) > MAX_TEXT_BYTES:
        raise ValueError(f"{len(text)} bytes, over the {MAX_TEXT_BYTES} limit")
    try:
        doc = orjson.loads(text)  # orjson refuses nesting past 1024 itself
    except orjson.JSONDecodeError as e:
        raise ValueError(f"not JSON: {e}") from None
    if not isinstance(doc, list):
        raise ValueError(f"not a list but {type(doc).__name__}")
    if len(doc) > MAX_RESERVATIONS:
        raise ValueError(f"{len(doc)} entries, over the {MAX_RESERVATIONS} limit")
    out: list[Reservation] = []
    seen: set[str] = set()
    for item in doc:
        if not isinstance(item, dict):
            raise ValueError(f"an entry is {type(item).__name__}, not an object")
        f: dict[str, Any] = item
        node = _str(f.get("node"), _MAX_NAME)
        if not DNS1123_SUBDOMAIN.fullmatch(node):
            raise ValueError(f"node {node[:64]!r} is not a Node name")
        until = f.get("until")
        if (
            not isinstance(until, int | float)
            or isinstance(until, bool)
            or not math.isfinite(until)
        ):
            raise ValueError(f"until {until!r} is not a time")
        r = Reservation(
            uid=_str(f.get("uid"), _MAX_UID),
            pod=_str(f.get("pod"), 2 * _MAX_NAME + 1),
            node=node,
            gpus=_int(f.get("gpus"), 0, 1 << 16),
            priority=_int(f.get("priority"), -_MAX_PRIORITY, _MAX_PRIORITY),
            until=float(until),
        )
        if r.until > max_until:
            continue
        if r.uid not in seen:  # one room per pod: the first one written
            seen.add(r.uid)
            out.append(r)
    return out


class KeptRooms(Protocol):
    """The rooms the rebalancer keeps, by node, as a program knows them: the extender
    from the rebalancer's Lease (`LeaseReservations`), the rebalancer from its own
    memory (rebalancer/state.py `LeaseState`). What the `reserved` plug-in reads."""

    def in_force(self, now: float) -> Mapping[str, Sequence[Reservation]]: ...


class LeaseReservations:
    """The rebalancer's reservations by node, from its Lease (fed by the extender's
    Lease watch, which sees every Lease of the namespace; only one is read).

    Replaced whole on each event, and read without copying: a request takes the
    current `(expiry, by_node)` pair in one attribute read."""

    def __init__(self, name: str = REBALANCER_LEASE, wall: Callable[[], float] = time.time) -> None:
        self.name = name
        self.wall = wall
        # (wall time the Lease stops being held, node -> its reservations)
        self._view: tuple[float, Mapping[str, Sequence[Reservation]]] = (-math.inf, {})
        self._text: object = None  # the annotation last decoded: renewals repeat it
        self._entries: list[Reservation] = []
        self._lock = threading.Lock()  # writers only (the watch thread, a relist)
        self.rejected = 0  # bad annotation values seen (a metric)
        self._log = LogLimiter()  # a bad value logged once per distinct reason

    def replace(self, items: Iterable[Mapping[str, Any]]) -> None:
        lease = next((o for o in items if _name(o) == self.name), None)
        if lease is None:
            self._set_view(-math.inf, [], None)
        else:
            self.event("ADDED", lease)

    def event(self, kind: str, obj: Mapping[str, Any]) -> None:
        if _name(obj) != self.name:
            return
        if kind == "DELETED":
            self._set_view(-math.inf, [], None)
            return
        now = self.wall()
        held = lease_held_until(obj, now)
        if held is None:
            # Released, not a Lease we can read, or out of our bounds (a renewTime from
            # the future, a duration past the cap): no room is kept for anyone.
            self._set_view(-math.inf, [], None)
            return
        held_until = held
        meta = obj.get("metadata")
        ann = meta.get("annotations") if isinstance(meta, Mapping) else None
        text = ann.get(RESERVATIONS_ANNOTATION) if isinstance(ann, Mapping) else None
        if text is None:
            self._set_view(held_until, [], None)
            return
        with self._lock:
            same = text == self._text
            entries = self._entries
        if not same:
            try:
                entries = decode(text, max_until=now + MAX_RESERVE_S + MAX_CLOCK_SKEW_S)
            except ValueError as e:
                self.rejected += 1
                if self._log.allow(str(e)[:80]):
                    logger.warning(
                        "extender: ignoring the reservations on Lease {}: {} (no room is kept)",
                        self.name,
                        e,
                    )
                entries = []
        self._set_view(held_until, entries, text)

    def _set_view(self, held_until: float, entries: list[Reservation], text: object) -> None:
        by_node: dict[str, list[Reservation]] = {}
        for r in entries:
            by_node.setdefault(r.node, []).append(r)
        with self._lock:
            self._text, self._entries = text, entries
            self._view = (held_until, by_node)

    def in_force(self, now: float) -> Mapping[str, Sequence[Reservation]]:
        """Node -> reservations, empty unless the Lease is held at `now` (wall time)."""
        held_until, by_node = self._view
        return by_node if now < held_until else {}

    def __len__(self) -> int:
        return len(self._entries)


def held_on(
    entries: Sequence[Reservation],
    uid: str,
    priority: int,
    now: float,
    pending: Callable[[str], Any],
) -> tuple[int, str]:
    """GPUs `entries` (one node's) keep from a pod `uid` of `priority`, and one holder
    ("ns/name") to name. Only for pods still pending (`pending(uid)`: the extender's
    own record of the pod, with the API's priority and requests), of at least
    `priority`, other than the pod itself."""
    held, holder = 0, ""
    for r in entries:
        if r.uid == uid or r.until <= now:
            continue
        p = pending(r.uid)
        if p is None or p.priority < priority:
            continue
        held += p.shape.gpus
        holder = holder or r.pod
    return held, holder


def _name(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata")
    name = meta.get("name") if isinstance(meta, Mapping) else None
    return name if isinstance(name, str) else ""


class ReservationCollector(Collector):
    """The reservations the extender reads, at scrape time."""

    def __init__(self, reservations: LeaseReservations, wall: Callable[[], float] = time.time):
        self.reservations, self.wall = reservations, wall

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        live = GaugeMetricFamily(
            "gpudaemon_extender_reservations",
            "Reservations on the rebalancer's Lease, while it holds it (room kept for a "
            "pending pod it evicted others for).",
        )
        live.add_metric([], sum(len(v) for v in self.reservations.in_force(self.wall()).values()))
        yield live
        bad = CounterMetricFamily(
            "gpudaemon_extender_reservations_rejected",
            "Times the reservations annotation on the rebalancer's Lease could not be read "
            "(too large, not JSON, a wrong type): then no room is kept.",
        )
        bad.add_metric([], self.reservations.rejected)
        yield bad
