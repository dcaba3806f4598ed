"""Whether a node's agent data is fresh: its agent's Lease is unexpired and owned by
the current Node object. Kept as one wall-clock deadline per node, computed at event
time, so a request compares one number per node. The Leases themselves are the Lease
informer's store, each kept as its `Entry` (`lease_entry` is that store's `keep`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from gpudaemon.kube.informers import Store
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


def lease_entry(obj: Obj) -> Entry:
    """What the Lease store keeps of a Lease (its `keep`): read as the event arrives,
    before any lock is taken."""
    return _expiry(obj)


def lease_key(obj: Obj) -> str:
    """The Lease store's key: the Lease's name (the node's; one namespace is watched)."""
    name = (obj.get("metadata") or {}).get("name")
    return name if isinstance(name, str) else ""


class Freshness:
    """The deadline each agent's Lease gives its node, from the Lease store (`leases`,
    `Entry` by node name). `node_uid(name)` and `is_bad(name)` come from the node store:
    a Lease left from a deleted Node of the same name, or a node whose data is
    unreadable, vouches for nothing. Not locked: ClusterState holds its lock around
    every call (the store has its own)."""

    def __init__(self, node_uid: Callable[[str], str], is_bad: Callable[[str], bool]) -> None:
        self._node_uid, self._is_bad = node_uid, is_bad
        self.leases = Store("leases", lease_entry, lease_key)  # until ClusterState.watch
        self._until: dict[str, float] = {}  # node -> wall time its data goes stale

    def until(self, name: str) -> float:
        """The wall time the node's data goes stale (-inf: no Lease vouches for it)."""
        return self._until.get(name, _NEVER)

    def _vouch(self, name: str) -> float | None:
        entry: Entry | None = self.leases.get(name)
        expiry, owner = entry if entry is not None else (None, "")
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
        names = self.leases.keys()  # a Store's, not a dict's
        self._until = {n: t for n in names if (t := self._vouch(n)) is not None}

    def drop(self, name: str) -> None:
        self._until.pop(name, None)

    def fresh(self, names: Iterable[str], now: float) -> dict[str, bool]:
        get = self._until.get
        return {n: now < get(n, _NEVER) for n in names}
