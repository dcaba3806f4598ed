"""Whether a node's agent data is fresh: its agent's Lease is unexpired and owned by
the current Node object. Kept as one wall-clock deadline per node, computed at event
time, so a request compares one number per node."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from gpudaemon.kube.lease import lease_expiry

Obj = Mapping[str, Any]
_NEVER = float("-inf")  # fresh until: no Lease vouches for the node


def _expiry(lease: Obj) -> tuple[float | None, str]:
    """(wall-clock expiry, owner Node UID) of a Lease. The expiry is the agent's own rule
    (`lease_expiry`, which `lease_is_fresh` applies), taken once per event rather than
    once per node per request."""
    owners = (lease.get("metadata") or {}).get("ownerReferences") or []
    owner = next((str(o.get("uid", "")) for o in owners if o.get("kind") == "Node"), "")
    expiry = lease_expiry(lease)
    return (None if expiry is None else expiry.timestamp()), owner


Entry = tuple[float | None, str]  # (wall-clock expiry, owner Node UID)


def lease_entry(kind: str, obj: Obj) -> tuple[str, Entry | None]:
    """(node name, what `Freshness.put` keeps for it; None: the Lease is gone), read
    from a watch event without the store's lock held."""
    name = str((obj.get("metadata") or {}).get("name", ""))
    return name, (None if kind == "DELETED" else _expiry(obj))


class Freshness:
    """The agents' Leases, by node name, and the deadline each gives its node.
    `node_uid(name)` and `is_bad(name)` come from the node store: a Lease left from a
    deleted Node of the same name, or a node whose data is unreadable, vouches for
    nothing. Not locked: ClusterState holds its lock around every call."""

    def __init__(self, node_uid: Callable[[str], str], is_bad: Callable[[str], bool]) -> None:
        self._node_uid, self._is_bad = node_uid, is_bad
        self.leases: dict[str, Entry] = {}  # node -> (expiry, owner)
        self._until: dict[str, float] = {}  # node -> wall time its data goes stale

    def clear(self) -> None:
        self.leases.clear()
        self._until.clear()

    def lease_event(self, kind: str, obj: Obj) -> None:
        self.put(*lease_entry(kind, obj))

    def put(self, name: str, entry: Entry | None) -> None:
        if entry is None:
            self.leases.pop(name, None)
        else:
            self.leases[name] = entry
        self.update(name)

    def until(self, name: str) -> float:
        """The wall time the node's data goes stale (-inf: no Lease vouches for it)."""
        return self._until.get(name, _NEVER)

    def _vouch(self, name: str) -> float | None:
        expiry, owner = self.leases.get(name, (None, ""))
        uid = self._node_uid(name)
        if expiry is None or (owner and uid and owner != uid) or self._is_bad(name):
            return None
        return expiry

    def update(self, name: str) -> None:
        """Recompute one node's deadline (its Node or its Lease changed)."""
        until = self._vouch(name)
        if until is None:
            self._until.pop(name, None)
        else:
            self._until[name] = until

    def recompute(self) -> None:
        """Every node's deadline (after a relist of the Nodes)."""
        self._until = {n: t for n in self.leases if (t := self._vouch(n)) is not None}

    def drop(self, name: str) -> None:
        self._until.pop(name, None)

    def fresh(self, names: Iterable[str], now: float) -> dict[str, bool]:
        get = self._until.get
        return {n: now < get(n, _NEVER) for n in names}
