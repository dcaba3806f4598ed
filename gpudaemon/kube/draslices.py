"""ResourceSlices of NVIDIA's DRA driver (resource.k8s.io/v1), read one way for every
program: the extender and the rebalancer count a node's devices from them, the agent
maps its GPUs to their DRA names. One parser for the object (`parse_slice`), one rule
for which slices count (`gather_pools`).

Which slices count is kube-scheduler's rule, from `GatherPools` and `addSlice` in
k8s.io/dynamic-resource-allocation/structured/internal/stable/pools_stable.go (1.37.2),
and the allocator's `if pool.IsIncomplete || pool.IsInvalid { continue }` in
allocator_stable.go:
- slices are grouped per pool (driver, pool name); only the newest `pool.generation`
  counts, older slices are ignored (a driver republishing a pool leaves both for a while);
- a pool counts only once `resourceSliceCount` slices of that generation are seen
  (incomplete: nothing is allocated from it);
- a pool whose device names repeat is invalid (`validateDeviceNames`): nothing either.
NVIDIA's driver publishes one pool per node, named after the node, in slices with
`nodeName` set, so every slice of a pool is the node's own (upstream's `checkSlicesInPool`
for slices of other nodes has nothing to find here).

What a device is (the one rule, for every program): its `type` attribute says so, "gpu"
or "mig" (NVIDIA's driver 0.4.x sets it on every device). A device without a `type`,
or with another one, is not a GPU: the extender does not count it, the agent neither
taints nor attributes it. kube-scheduler agrees where it matters: NVIDIA's DeviceClasses
select on `type`, which such a device cannot match.

Bounded and defensive: a slice of the wrong shape or over a cap raises `BadDraObject`
(the caller counts and skips it); a malformed device is skipped and counted in
`Slice.skipped`, and the rest of its slice stays.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

DRIVER = "gpu.nvidia.com"
# resource.k8s.io/v1 ResourceSliceMaxDevices: no slice the API server accepts is refused.
MAX_DEVICES = 128
MAX_TEXT = 253
_MAX_SLICES = 1 << 16  # resourceSliceCount beyond any node
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_UUID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
_PROFILE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.+_-]{0,62}$")
TAINT_EFFECTS = ("NoSchedule", "NoExecute")  # what keeps a new claim off a device
KINDS = ("gpu", "mig")


class BadDraObject(ValueError):
    """An object of the wrong shape or over a cap; `reason` is one short line."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Device:
    """One device of NVIDIA's driver in a slice."""

    name: str
    kind: str  # "gpu", "mig", or "" (no or another `type`: not a GPU)
    uuid: str = ""
    profile: str = ""  # MIG only
    parent_uuid: str = ""  # MIG only: the GPU it is carved from
    tainted: bool = False  # a NoSchedule/NoExecute taint in the slice itself
    no_execute: bool = False

    @property
    def gpu_uuid(self) -> str:
        """The physical GPU's UUID (the agent's `gpus` annotation is keyed by it)."""
        return self.parent_uuid if self.kind == "mig" else self.uuid


@dataclass(frozen=True, slots=True)
class Slice:
    node: str
    pool: str
    devices: tuple[Device, ...]
    generation: int = 0
    slice_count: int = 1  # the pool's resourceSliceCount
    skipped: int = 0  # malformed devices left out


def _obj(v: object, what: str) -> Mapping[str, object]:
    if v is None:
        return {}
    if not isinstance(v, Mapping):
        raise BadDraObject(f"{what} is not an object")
    return v


def _text(v: object, what: str, cap: int = MAX_TEXT) -> str:
    if v is None:
        return ""
    if not isinstance(v, str) or len(v) > cap:
        raise BadDraObject(f"{what} is not a string of at most {cap} characters")
    return v


def _whole(v: object, what: str, lo: int, hi: int, default: int) -> int:
    if v is None:
        return default
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise BadDraObject(f"{what} is not a whole number in [{lo}, {hi}]")
    return v


def _attr(attrs: Mapping[str, object], name: str) -> str:
    """A string attribute, by its bare or driver-qualified name; "" when absent."""
    for key in (name, f"{DRIVER}/{name}"):
        v = attrs.get(key)
        if v is not None:
            return _text(_obj(v, f"attribute {name}").get("string"), f"attribute {name}", 128)
    return ""


def _device(d: object) -> Device:
    d = _obj(d, "a device")
    name = _text(d.get("name"), "device name")
    if not _DNS_LABEL.match(name):
        raise BadDraObject("a device name that is not a DNS label")
    attrs = _obj(d.get("attributes"), "device attributes")
    kind = _attr(attrs, "type")
    uuid, parent = _attr(attrs, "uuid"), _attr(attrs, "parentUUID")
    profile = _attr(attrs, "profile")
    for value, pattern, what in ((uuid, _UUID, "uuid"), (parent, _UUID, "parentUUID"),
                                 (profile, _PROFILE, "profile")):  # fmt: skip
        if value and not pattern.match(value):
            raise BadDraObject(f"a device {what} of the wrong form")
    taints = d.get("taints")
    if taints is not None and (not isinstance(taints, list) or len(taints) > 16):
        raise BadDraObject("device taints are not a list of at most 16")
    effects = {_obj(t, "a taint").get("effect") for t in taints or ()}
    return Device(
        name,
        kind if kind in KINDS else "",
        uuid,
        profile,
        parent,
        bool(effects & set(TAINT_EFFECTS)),
        "NoExecute" in effects,
    )


def parse_slice(obj: object) -> Slice | None:
    """The slice of NVIDIA's driver, or None for another driver's or a slice not local
    to one node (network-attached devices are not ours to count)."""
    o = _obj(obj, "slice")
    meta = _obj(o.get("metadata"), "metadata")
    if not _text(meta.get("name"), "metadata.name"):
        raise BadDraObject("no metadata.name")
    spec = _obj(o.get("spec"), "spec")
    if spec.get("driver") != DRIVER:
        return None
    node = _text(spec.get("nodeName"), "spec.nodeName")
    pool = _obj(spec.get("pool"), "spec.pool")
    name = _text(pool.get("name"), "spec.pool.name")
    if not node or not name:
        return None
    if name != node:
        # NVIDIA's driver names each node's pool after the node. Any other name would
        # let one node's slice speak for another node's pool (its allocations, its
        # taint rules), so such a slice is refused, not trusted.
        raise BadDraObject(f"pool {name[:64]!r} is not named after its node {node[:64]!r}")
    generation = _whole(pool.get("generation"), "spec.pool.generation", 0, 2**63 - 1, 0)
    count = pool.get("resourceSliceCount")
    if count is None:
        raise BadDraObject("no spec.pool.resourceSliceCount")
    count = _whole(count, "spec.pool.resourceSliceCount", 1, _MAX_SLICES, 1)
    raw = spec.get("devices")
    if raw is not None and not isinstance(raw, list):
        raise BadDraObject("spec.devices is not a list")
    if raw is not None and len(raw) > MAX_DEVICES:
        raise BadDraObject(f"spec.devices: more than {MAX_DEVICES} entries")
    devices, skipped = [], 0
    for d in raw or ():
        try:
            devices.append(_device(d))
        except BadDraObject:
            skipped += 1
    return Slice(node, name, tuple(devices), generation, count, skipped)


def gather_pools(slices: Iterable[Slice]) -> dict[str, tuple[Device, ...]]:
    """Pool name -> its devices, for the pools kube-scheduler allocates from: the
    newest generation of each, complete (`resourceSliceCount` slices of it) and with
    unique device names. All slices here are NVIDIA's (one driver)."""
    newest: dict[str, list[Slice]] = {}
    for s in slices:  # addSlice: an older generation is ignored, a newer one replaces
        have = newest.get(s.pool)
        if have is None or s.generation > have[0].generation:
            newest[s.pool] = [s]
        elif s.generation == have[0].generation:
            have.append(s)
    out: dict[str, tuple[Device, ...]] = {}
    for pool, group in newest.items():
        if len(group) != group[0].slice_count:
            continue  # incomplete: the driver is still publishing this generation
        devices = tuple(d for s in group for d in s.devices)
        if len({d.name for d in devices}) != len(devices):
            continue  # invalid: a device name twice
        out[pool] = devices
    return out
