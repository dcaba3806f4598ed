"""Keeping an assumed DRA pod's devices counted until its claims' allocations are seen.

kube-scheduler's DynamicResources plug-in writes each claim's `status.allocation`, then
binds the pod; the claim watch and the pod watch deliver those in either order. If the
assumption went the instant the pod was seen bound (as a device-plugin pod's does: its
binding carries its requests), a claim event still on its way would leave the devices
counted nowhere, and the next pods of a burst would be ranked onto GPUs that are taken.
So an assumed pod's claim parts (`PodShape.dra`) stay assumed, on the node it was bound
to, until the claim shows allocated (then the allocation counts them), the pod goes, or
the assumption's time runs out. A claim allocated before the pod binds stops being
assumed at once (its allocation already counts).

Not locked: ClusterState holds its lock around every call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any

from gpudaemon.cluster.assume import PodUsage
from gpudaemon.cluster.drastate import DraState
from gpudaemon.cluster.state import MigCounts, NodeState, PodShape, add_mig

Obj = Mapping[str, Any]
Parts = tuple[tuple[str, int, MigCounts], ...]
MAX_PODS = 10_000  # assumed DRA pods remembered; past it, those no longer assumed go


class DraAssumptions:
    def __init__(
        self, usage: PodUsage, allocated: Callable[[str], bool], dra: DraState | None = None
    ) -> None:
        self._usage, self._dra = usage, dra
        self._allocated = allocated  # claim key -> its allocation is seen
        self._pods: dict[str, PodShape] = {}  # UID -> shape assumed, with its DRA parts
        self._by_claim: dict[str, set[str]] = {}  # claim key -> UIDs

    def note(self, uid: str, shape: PodShape) -> None:
        """The pod was assumed with `shape`: remember its claims."""
        self.forget(uid)
        if not shape.dra:
            return
        if len(self._pods) >= MAX_PODS:
            for u in [u for u in self._pods if self._usage.assumed.get(u) is None]:
                self.forget(u)
        self._pods[uid] = shape
        for key, _, _ in shape.dra:
            if key:
                self._by_claim.setdefault(key, set()).add(uid)

    def forget(self, uid: str) -> None:
        shape = self._pods.pop(uid, None)
        for key, _, _ in shape.dra if shape is not None else ():
            uids = self._by_claim.get(key)
            if uids is not None:
                uids.discard(uid)
                if not uids:
                    del self._by_claim[key]

    def tracks(self, uid: str) -> bool:
        return uid in self._pods

    def pods_of(self, claim_key: str) -> list[str]:
        return list(self._by_claim.get(claim_key, ()))

    def all_pods(self) -> list[str]:
        return list(self._pods)

    def shared(self, uid: str, shape: PodShape) -> dict[str, tuple[int, MigCounts, Parts]]:
        """Node -> (GPUs, MIG devices, parts) of the pod's claims that another pod's
        assumption holds there (a ResourceClaim two pods name): counted there once, by
        that assumption, so neither this pod's ranking nor its assumption counts them
        again."""
        out: dict[str, tuple[int, MigCounts, Parts]] = {}
        for part in shape.dra:
            nodes: set[str] = set()
            for other in self._by_claim.get(part[0], ()) if part[0] else ():
                a, held = self._usage.assumed.get(other), self._pods.get(other)
                if other == uid or a is None or held is None or a.node in nodes:
                    continue
                if any(p[0] == part[0] for p in held.dra):
                    nodes.add(a.node)
                    g, m, ps = out.get(a.node, (0, (), ()))
                    out[a.node] = (g + part[1], add_mig(m, part[2]), (*ps, part))
        return out

    def credit(
        self, uid: str, shape: PodShape | None, states: dict[str, NodeState | None]
    ) -> dict[str, NodeState | None]:
        """The states as the pod sees them: on a node where another pod's assumption
        holds one of its claims, those devices are the pod's own (requested and assumed
        less them; the filter's bound counts are unchanged)."""
        if shape is None or not shape.dra:
            return states
        for node, (g, m, _) in self.shared(uid, shape).items():
            st = states.get(node)
            if st is not None:
                states[node] = replace(
                    st, gpus_requested=st.gpus_requested - g, gpus_assumed=st.gpus_assumed - g,
                    mig_requested=add_mig(st.mig_requested, m, -1),
                    mig_assumed=add_mig(st.mig_assumed, m, -1))  # fmt: skip
        return states

    def unshared(self, uid: str, node: str, shape: PodShape) -> PodShape:
        """`shape` less the claims another pod's assumption holds on `node`."""
        g, m, parts = self.shared(uid, shape).get(node, (0, (), ()))
        if not parts:
            return shape
        return replace(shape, gpus=shape.gpus - g, mig=add_mig(shape.mig, m, -1),
                       dra=tuple(p for p in shape.dra if p not in parts))  # fmt: skip

    def settle(self, uid: str, bound_node: str, now: float) -> None:
        """Re-assume what is still due: the claims not yet seen allocated, and (while
        the pod is unbound) its own requests; drop the assumption when nothing is."""
        full = self._pods.get(uid)
        a = self._usage.assumed.get(uid)
        if full is None or a is None:
            self.forget(uid)
            if a is not None and bound_node:  # bound: the binding replaces it
                self._usage.drop_assumed(uid)
            return
        left = tuple(p for p in full.dra if p[0] and not self._allocated(p[0]))
        if left == full.dra and not bound_node:
            return  # unchanged
        gpus = sum(p[1] for p in left)
        mig: tuple[tuple[str, int], ...] = ()
        for p in left:
            mig = add_mig(mig, p[2])
        if bound_node:
            shape, node = PodShape(gpus=gpus, mig=mig, dra=left), bound_node
        else:
            gone_gpus = sum(p[1] for p in full.dra) - gpus
            gone_mig: tuple[tuple[str, int], ...] = ()
            for p in full.dra:
                if p not in left:
                    gone_mig = add_mig(gone_mig, p[2])
            shape = replace(full, gpus=full.gpus - gone_gpus,
                            mig=add_mig(full.mig, gone_mig, -1), dra=left)  # fmt: skip
            node = a.node
        if not left:
            self.forget(uid)
        if not shape.wants_gpus and not (shape.cpu_milli or shape.memory_bytes):
            self._usage.drop_assumed(uid)
            return
        if left:
            self._pods[uid] = shape
        ttl = max(0.001, a.expires_at - now)
        self._usage.assume(uid, node, shape, now, ttl, a.gang, a.assumed_wall)

    # -- the watches' handlers (ClusterState hands out these) ---------------------------

    def handler(
        self, kind: str, lock: AbstractContextManager[Any], settle: Callable[[str], None]
    ) -> Callable[[str, Obj], None]:
        d = self._dra
        assert d is not None

        def claim(k: str, obj: Obj) -> None:
            c = d.claim_event(k, obj)
            if c is not None and c.allocated:
                for uid in self.pods_of(c.key):
                    settle(uid)

        handle = {"resourceslices": d.slice_event, "resourceclaims": claim,
                  "deviceclasses": d.class_event, "resourceclaimtemplates": d.template_event,
                  "devicetaintrules": d.rule_event}[kind]  # fmt: skip

        def event(k: str, obj: Obj) -> None:
            with lock:
                handle(k, obj)

        return event

    def replacer(
        self, kind: str, lock: AbstractContextManager[Any], settle: Callable[[str], None]
    ) -> Callable[[Iterable[Obj]], None]:
        d = self._dra
        assert d is not None
        handle = {"resourceslices": d.replace_slices, "resourceclaims": d.replace_claims,
                  "deviceclasses": d.replace_classes, "resourceclaimtemplates":
                  d.replace_templates, "devicetaintrules": d.replace_rules}[kind]  # fmt: skip

        def replace_all(items: Iterable[Obj]) -> None:
            with lock:
                handle(items)
                if kind == "resourceclaims":
                    for uid in self.all_pods():
                        settle(uid)

        return replace_all
