"""The DRA objects the extender and the rebalancer watch, kept as `dra.py` reads them,
and what they mean per node: NVIDIA GPU and MIG devices in the node's slices, those
allocated to claims, and those tainted (NoSchedule/NoExecute, in the slice or by a
DeviceTaintRule) that no claim holds. Also a pod's needs: the GPU and MIG counts of its
claims not yet allocated.

Not locked: ClusterState holds its lock around every call. Each handler takes an
object as the API server sent it or in its kept form (`dra.kept_form`, what the
watches hand over: parsed as it arrived, the raw object gone). Objects that cannot be read
are skipped and counted by kind (`bad`); a pod's claims we cannot judge are counted
once per claim by reason (`not_understood`) and get no opinion.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import cast

from gpudaemon.cluster.dra import (
    DRIVER,
    Alternatives,
    BadDraObject,
    Claim,
    Device,
    Match,
    Slice,
    TaintRule,
    gather_pools,
    merge,
    parse_claim,
    parse_class,
    parse_slice,
    parse_taint_rule,
    parse_template,
    read_kept,
)
from gpudaemon.cluster.state import MigCounts, NodeState, add_mig

_COUNTED_CAP = 10_000  # claims remembered as counted in the not-understood metric


@dataclass(frozen=True, slots=True)
class DraCounts:
    """One node's devices. `tainted_free` are GPU UUIDs: the caller leaves out those
    its agent already reports unhealthy, so a device is subtracted once."""

    gpus: int = 0
    mig: MigCounts = ()
    gpus_allocated: int = 0
    mig_allocated: MigCounts = ()
    tainted_free: tuple[str, ...] = ()
    mig_tainted_free: MigCounts = ()


@dataclass(frozen=True, slots=True)
class Needs:
    """A pod's claims not yet allocated, summed; `parts` per claim key (for keeping an
    assumption until each claim's allocation is seen). `reason`: no opinion."""

    gpus: int = 0
    mig: MigCounts = ()
    parts: tuple[tuple[str, int, MigCounts], ...] = ()
    reason: str = ""


NO_NEEDS = Needs()


class DraState:
    def __init__(self, changed: Callable[[str], None]) -> None:
        self._changed = changed  # a node's counts changed
        self.slices: dict[str, Slice] = {}
        self._pool_node: dict[str, str] = {}
        self._node_slices: dict[str, set[str]] = {}
        self.claims: dict[str, Claim] = {}
        self.classes: dict[str, Match | None] = {}
        self.templates: dict[str, tuple[Alternatives, ...]] = {}
        self.rules: dict[str, TaintRule] = {}
        # The rules by the pool they select (None: every pool), so a rule event recounts
        # only its pool's node, and a device checks only the rules that can select it:
        # an agent may write any number of rules for its own pool.
        self._pool_rules: dict[str | None, dict[str, TaintRule]] = {}
        self._allocated: dict[tuple[str, str, str], int] = {}
        self._counts: dict[str, DraCounts] = {}
        self.bad: dict[str, int] = {}  # by kind: objects skipped
        self.not_understood: dict[str, int] = {}  # by reason: claims with no opinion
        self._counted: set[tuple[str, str]] = set()

    def _bad(self, kind: str) -> None:
        self.bad[kind] = self.bad.get(kind, 0) + 1

    def _touch(self, nodes: Iterable[str]) -> None:
        for n in nodes:
            self._counts.pop(n, None)
            self._changed(n)

    def nodes(self) -> list[str]:
        return list(self._node_slices)

    # -- slices --------------------------------------------------------------------

    def slice_event(self, kind: str, obj: object) -> None:
        name = _name(obj)
        old = self.slices.pop(name, None)
        touched = set()
        if old is not None:
            touched.add(old.node)
            names = self._node_slices.get(old.node, set())
            names.discard(name)
            if not names:
                self._node_slices.pop(old.node, None)
                self._pool_node.pop(old.pool, None)
        if kind != "DELETED":
            try:
                s = read_kept(obj, parse_slice)
            except BadDraObject:
                self._bad("resourceslices")
                s = None
            if s is not None:
                self.slices[name] = s
                self._node_slices.setdefault(s.node, set()).add(name)
                self._pool_node[s.pool] = s.node
                touched.add(s.node)
        self._touch(touched)

    def replace_slices(self, items: Iterable[object]) -> None:
        for name in list(self.slices):
            self.slice_event("DELETED", {"metadata": {"name": name}})
        for obj in items:
            self.slice_event("ADDED", obj)

    # -- claims --------------------------------------------------------------------

    def claim_event(self, kind: str, obj: object) -> Claim | None:
        """The claim as now held (None: gone or unreadable)."""
        key = _key(obj)
        old = self.claims.pop(key, None)
        touched = set()
        if old is not None:
            touched |= self._allocate(old, -1)
        new = None
        if kind != "DELETED":
            try:
                new = read_kept(obj, parse_claim)
            except BadDraObject:
                self._bad("resourceclaims")
        if new is not None:
            self.claims[key] = new
            touched |= self._allocate(new, +1)
        self._touch(touched)
        return new

    def replace_claims(self, items: Iterable[object]) -> None:
        self.claims.clear()
        self._allocated.clear()
        self._counts.clear()
        for obj in items:
            self.claim_event("ADDED", obj)
        self._touch(list(self._node_slices))

    def _allocate(self, c: Claim, sign: int) -> set[str]:
        nodes = set()
        for r in c.results:
            n = self._allocated.get(r, 0) + sign
            if n > 0:
                self._allocated[r] = n
            else:
                self._allocated.pop(r, None)
            if r[0] == DRIVER and (node := self._pool_node.get(r[1])):
                nodes.add(node)
        return nodes

    # -- classes, templates, taint rules -------------------------------------------

    def class_event(self, kind: str, obj: object) -> None:
        if kind == "DELETED":
            self.classes.pop(_name(obj), None)
            return
        try:
            name, match = read_kept(obj, parse_class)
        except BadDraObject:
            self._bad("deviceclasses")
            self.classes.pop(_name(obj), None)
            return
        self.classes[name] = match

    def replace_classes(self, items: Iterable[object]) -> None:
        self.classes.clear()
        for obj in items:
            self.class_event("ADDED", obj)

    def template_event(self, kind: str, obj: object) -> None:
        key = _key(obj)
        self.templates.pop(key, None)
        if kind == "DELETED":
            return
        try:
            key, reqs = read_kept(obj, parse_template)
        except BadDraObject:
            self._bad("resourceclaimtemplates")
            return
        self.templates[key] = reqs

    def replace_templates(self, items: Iterable[object]) -> None:
        self.templates.clear()
        for obj in items:
            self.template_event("ADDED", obj)

    def rule_event(self, kind: str, obj: object, recount: bool = True) -> None:
        name = _name(obj)
        pools: set[str | None] = set()
        old = self.rules.pop(name, None)
        if old is not None:
            pools.add(old.pool)
            by_pool = self._pool_rules.get(old.pool, {})
            by_pool.pop(name, None)
            if not by_pool:
                self._pool_rules.pop(old.pool, None)
        if kind != "DELETED":
            try:
                rule = read_kept(obj, parse_taint_rule)
            except BadDraObject:
                self._bad("devicetaintrules")
                rule = None
            if rule is not None:
                self.rules[name] = rule
                self._pool_rules.setdefault(rule.pool, {})[name] = rule
                pools.add(rule.pool)
        if recount:
            if None in pools:  # a rule for every pool
                self._touch(list(self._node_slices))
            else:
                self._touch(n for p in pools if p is not None and (n := self._pool_node.get(p)))

    def replace_rules(self, items: Iterable[object]) -> None:
        self.rules.clear()
        self._pool_rules.clear()
        for obj in items:
            self.rule_event("ADDED", obj, recount=False)
        self._touch(list(self._node_slices))

    # -- reads ---------------------------------------------------------------------

    def devices(self, node: str) -> Iterable[tuple[str, Device]]:
        """(pool, device) of the node's NVIDIA devices: of the pools kube-scheduler
        allocates from (`gather_pools`: the newest generation, once complete)."""
        pools = gather_pools(self.slices[n] for n in self._node_slices.get(node, ()))
        for pool, devices in pools.items():
            for d in devices:
                yield pool, d

    def taint(self, pool: str, d: Device) -> tuple[bool, bool]:
        """(tainted NoSchedule or NoExecute, NoExecute), from the slice and the rules."""
        tainted, no_exec = d.tainted, d.no_execute
        for key in (pool, None):
            for r in self._pool_rules.get(key, {}).values():
                if r.selects(DRIVER, pool, d.name):
                    tainted, no_exec = True, no_exec or r.no_execute
        return tainted, no_exec

    def is_allocated(self, pool: str, device: str) -> bool:
        return (DRIVER, pool, device) in self._allocated

    def counts(self, node: str) -> DraCounts | None:
        """The node's devices (cached until its slices, claims or the rules change);
        None for a node with no slice of NVIDIA's driver."""
        c = self._counts.get(node)
        if c is not None or node not in self._node_slices:
            return c
        gpus = alloc = 0
        mig: MigCounts = ()
        mig_alloc: MigCounts = ()
        mig_tainted: MigCounts = ()
        tainted: list[str] = []
        devices = list(self.devices(node))
        # A driver that publishes a GPU beside its MIG devices (dynamic MIG, with shared
        # counters) lets only one side be allocated: a GPU with a MIG device allocated
        # is no free GPU, and the MIG devices of an allocated GPU are not free either.
        whole: set[str] = set()
        carved: set[str] = set()
        for pool, d in devices:
            if d.gpu_uuid and self.is_allocated(pool, d.name):
                (whole if d.kind == "gpu" else carved).add(d.gpu_uuid)
        for pool, d in devices:
            if not d.kind or (d.kind == "mig" and not d.profile):
                continue
            used = self.is_allocated(pool, d.name) or bool(
                d.gpu_uuid and d.gpu_uuid in (carved if d.kind == "gpu" else whole)
            )
            bad = not used and self.taint(pool, d)[0]
            if d.kind == "gpu":
                gpus += 1
                alloc += used
                if bad:
                    tainted.append(d.uuid or f"{pool}/{d.name}")
            else:
                one = ((d.profile, 1),)
                mig = add_mig(mig, one)
                if used:
                    mig_alloc = add_mig(mig_alloc, one)
                if bad:
                    mig_tainted = add_mig(mig_tainted, one)
        c = DraCounts(gpus, mig, alloc, mig_alloc, tuple(tainted), mig_tainted)
        self._counts[node] = c
        return c

    def needs(self, refs: Iterable[tuple[str, str]]) -> Needs:
        """What the pod's claims (`dra.pod_claim_refs`) still need: claims already
        allocated add nothing; a claim not yet created is read from its template."""
        gpus, mig, parts = 0, cast(MigCounts, ()), []
        for claim_key, template_key in refs:
            claim = self.claims.get(claim_key) if claim_key else None
            if claim is not None:
                if claim.allocated:
                    continue
                reqs = claim.requests
            elif template_key in self.templates:
                reqs = self.templates[template_key]
            else:
                return self._no_opinion(claim_key or template_key, "missing")
            g, m, other = 0, cast(MigCounts, ()), False
            for alts in reqs:
                rg, rm, why = self._resolve(alts)
                if why and why != "other_driver":
                    return self._no_opinion(claim_key or template_key, why)
                g, m, other = g + rg, add_mig(m, rm), other or why == "other_driver"
            if other:
                self._count(claim_key or template_key, "other_driver")
            gpus, mig = gpus + g, add_mig(mig, m)
            parts.append((claim_key, g, m))
        return Needs(gpus, mig, tuple(parts)) if gpus or mig else NO_NEEDS

    def _resolve(self, alts: Alternatives) -> tuple[int, MigCounts, str]:
        """One request's (GPUs, MIG devices) as the least of its alternatives, or a
        reason it cannot be judged ("other_driver": not ours, counts nothing)."""
        shapes: list[tuple[int, MigCounts]] = []
        for r in alts:
            if r.bad:
                return 0, (), r.bad
            if r.device_class not in self.classes:
                return 0, (), "unknown_class"
            match = merge(self.classes[r.device_class], r.match)
            if match is None:
                return 0, (), "cel"
            if match.driver is not None and match.driver != DRIVER:
                shapes.append((0, ()))
                continue
            if match.type == "gpu":
                shapes.append((r.count, ()))
            elif match.type == "mig":
                if match.profile is None:
                    return 0, (), "mig_any_profile"
                shapes.append((0, ((match.profile, r.count),)))
            elif match.type is None:
                return 0, (), "any_device"
            else:
                return 0, (), "cel"
        if all(s == (0, ()) for s in shapes):
            return 0, (), "other_driver"
        if len({bool(s[1]) for s in shapes}) > 1 or len({s[1] for s in shapes if s[1]}) > 1:
            return 0, (), "first_available"  # alternatives of different kinds
        # The least an alternative needs: never turns away a node one would fit.
        g, m = min(shapes, key=lambda s: s[0])
        return g, m, ""

    def _no_opinion(self, key: str, reason: str) -> Needs:
        self._count(key, reason)
        return Needs(reason=reason)

    def _count(self, key: str, reason: str) -> None:
        if (key, reason) in self._counted:
            return
        if len(self._counted) >= _COUNTED_CAP:
            self._counted.clear()
        self._counted.add((key, reason))
        self.not_understood[reason] = self.not_understood.get(reason, 0) + 1

    def fold(self, st: NodeState) -> NodeState:
        """The node with its devices: GPUs and MIG devices added to its allocatable,
        less the tainted ones no claim holds; a tainted GPU the agent reports unhealthy
        stays, as `gpus_unhealthy` subtracts it already (subtracted once)."""
        c = self.counts(st.name)
        if c is None:
            return st
        tainted = sum(1 for u in c.tainted_free if u not in st.unhealthy_uuids)
        mig = add_mig(add_mig(st.mig_allocatable, c.mig), c.mig_tainted_free, -1)
        return replace(st, gpus_allocatable=st.gpus_allocatable + c.gpus - tainted,
                       mig_allocatable=mig)  # fmt: skip

    def is_claim_allocated(self, key: str) -> bool:
        c = self.claims.get(key)
        return c is not None and c.allocated

    def holders(self, node: str, gpu_uuid: str) -> list[str]:
        """UIDs of the pods holding, through an allocated claim, a device of the node's
        slices on the GPU `gpu_uuid` (the GPU itself or a MIG device carved from it)."""
        devices = {(DRIVER, pool, d.name) for pool, d in self.devices(node)
                   if gpu_uuid and d.gpu_uuid == gpu_uuid}  # fmt: skip
        if not devices:
            return []
        out: list[str] = []
        for c in self.claims.values():
            if c.allocated and any(r in devices for r in c.results):
                out += [u for u in c.reserved_for if u not in out]
        return out

    def sizes(self) -> dict[str, int]:
        return {"resourceslices": len(self.slices), "resourceclaims": len(self.claims)}


def _name(obj: object) -> str:
    try:
        name = obj.get("metadata", {}).get("name")  # type: ignore[attr-defined]
    except AttributeError:
        return ""
    return name if isinstance(name, str) else ""


def _key(obj: object) -> str:
    try:
        ns = obj.get("metadata", {}).get("namespace")  # type: ignore[attr-defined]
    except AttributeError:
        ns = ""
    return f"{ns if isinstance(ns, str) else ''}/{_name(obj)}"
