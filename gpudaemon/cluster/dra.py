"""Reading Dynamic Resource Allocation objects (resource.k8s.io/v1) into our own values:
ResourceClaims (and the requests of ResourceClaimTemplates), DeviceClasses and
DeviceTaintRules; ResourceSlices through the one parser every program shares
(`kube/draslices.py`: newest complete generation of a pool only, and what a device
is). Pure: no client, no state; `drastate.py` keeps them.

Only NVIDIA's driver (`gpu.nvidia.com`, kubernetes-sigs/dra-driver-nvidia-gpu 0.4.x) is
understood: devices `gpu-<minor>` with attribute `type` "gpu", and MIG devices with
`type` "mig", `profile` and `parentUUID`. A class or selector is understood only when
its CEL is a conjunction of equalities on `device.driver` and the driver's `type` and
`profile` attributes (what NVIDIA's own DeviceClasses say); anything else is "not
understood", and the extender then has no opinion on the claim (never filters for it).

Bounded and defensive, as `labels/annotations.py`: an object over a cap or of the wrong
shape raises `BadDraObject` (the store counts and skips it), never anything else.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

# The one ResourceSlice parser and pool rule, shared with the agent (kube/draslices.py).
from gpudaemon.kube.draslices import DRIVER as DRIVER
from gpudaemon.kube.draslices import MAX_DEVICES as MAX_DEVICES
from gpudaemon.kube.draslices import TAINT_EFFECTS
from gpudaemon.kube.draslices import BadDraObject as BadDraObject
from gpudaemon.kube.draslices import Device as Device
from gpudaemon.kube.draslices import Slice as Slice
from gpudaemon.kube.draslices import gather_pools as gather_pools
from gpudaemon.kube.draslices import parse_slice as parse_slice

# resource.k8s.io/v1's own limits (DeviceRequestsMax, AllocationResultsMaxSize,
# DeviceSelectorsMaxSize, ResourceClaimReservedForMaxSize), so no object the API
# server accepts is refused, and none is unbounded.
MAX_REQUESTS = 32
MAX_SUBREQUESTS = 8
MAX_RESULTS = 32
MAX_SELECTORS = 32
MAX_RESERVED_FOR = 256
MAX_CEL_CHARS = 10 * 1024
MAX_TEXT = 253
MAX_COUNT = 1024  # devices one request asks for; more is beyond any node

# Why a claim gets no opinion: gpudaemon_extender_dra_claims_not_understood_total{reason}.
NOT_UNDERSTOOD = (
    "cel",  # a selector or class CEL that is not a plain driver/type/profile conjunction
    "unknown_class",  # the DeviceClass is not (yet) in the cache
    "all_devices",  # allocationMode All: as many as the node has
    "admin_access",  # adminAccess: monitoring access, takes no device
    "tolerations",  # may use tainted devices, which we never count as free
    "mig_any_profile",  # MIG devices of any profile
    "any_device",  # the driver's GPUs or MIG devices alike
    "first_available",  # firstAvailable alternatives of different kinds
    "capacity",  # consumable capacity (a share of a device)
    "unreadable",  # a claim or template we could not read
    "missing",  # the pod's claim (and template) are not in the cache
    "other_driver",  # a request for another driver's devices: counts nothing here
)


@dataclass(frozen=True, slots=True)
class Match:
    """What a CEL conjunction pins down (None: not constrained)."""

    driver: str | None = None
    type: str | None = None
    profile: str | None = None


@dataclass(frozen=True, slots=True)
class Request:
    """One `exactly` request (or a `firstAvailable` alternative), unresolved: its class
    is looked up when a pod is judged, as classes come and go. `bad` is a reason from
    NOT_UNDERSTOOD that holds whatever the class says."""

    device_class: str
    match: Match | None  # its own selectors; None: CEL we cannot read
    count: int = 1
    bad: str = ""


# A request: one alternative (exactly) or several (firstAvailable), in order.
Alternatives = tuple[Request, ...]


@dataclass(frozen=True, slots=True)
class Claim:
    namespace: str
    name: str
    uid: str
    requests: tuple[Alternatives, ...]
    bad: str = ""  # the whole claim is not understood (e.g. unreadable spec)
    results: tuple[tuple[str, str, str], ...] = ()  # allocated (driver, pool, device)
    allocated: bool = False
    reserved_for: tuple[str, ...] = ()  # pod UIDs

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True, slots=True)
class TaintRule:
    driver: str | None
    pool: str | None
    device: str | None
    no_execute: bool

    def selects(self, driver: str, pool: str, device: str) -> bool:
        return (
            (self.driver is None or self.driver == driver)
            and (self.pool is None or self.pool == pool)
            and (self.device is None or self.device == device)
        )


# -- small readers ---------------------------------------------------------------------


def _obj(v: object, what: str) -> Mapping[str, object]:
    if v is None:
        return {}
    if not isinstance(v, Mapping):
        raise BadDraObject(f"{what} is not an object")
    return v


def _list(v: object, what: str, cap: int) -> list[object]:
    if v is None:
        return []
    if not isinstance(v, list):
        raise BadDraObject(f"{what} is not a list")
    if len(v) > cap:
        raise BadDraObject(f"{what}: more than {cap} entries")
    return v


def _text(v: object, what: str, cap: int = MAX_TEXT, default: str = "") -> str:
    if v is None:
        return default
    if not isinstance(v, str) or len(v) > cap:
        raise BadDraObject(f"{what} is not a string of at most {cap} characters")
    return v


def _meta(obj: object) -> tuple[str, str, str]:
    """(namespace, name, uid) of an object."""
    meta = _obj(_obj(obj, "object").get("metadata"), "metadata")
    name = _text(meta.get("name"), "metadata.name")
    if not name:
        raise BadDraObject("no metadata.name")
    return _text(meta.get("namespace"), "metadata.namespace"), name, _text(meta.get("uid"), "uid")


# -- CEL ---------------------------------------------------------------------------------

_Q = r"'([^'\\]{0,253})'"
_DRIVER_EQ = re.compile(rf"^device\.driver=={_Q}$|^{_Q}==device\.driver$")
_ATTR_EQ = re.compile(
    rf"^device\.attributes\[{_Q}\]\.(type|profile)=={_Q}$|^{_Q}==device\.attributes\[{_Q}\]\.(type|profile)$"
)


def parse_cel(expression: object) -> Match | None:
    """The Match of a conjunction of equalities on the driver and on NVIDIA's `type`
    and `profile` attributes; None for any other CEL (not understood)."""
    if not isinstance(expression, str) or len(expression) > MAX_CEL_CHARS:
        return None
    text = re.sub(r"\s+", "", expression).replace('"', "'")
    while text.startswith("(") and text.endswith(")") and text.count("(") == 1:
        text = text[1:-1]
    found: dict[str, str] = {}
    for term in text.split("&&"):
        term = term.strip("()") if term.count("(") == term.count(")") else term
        if m := _DRIVER_EQ.match(term):
            key, value = "driver", m.group(1) if m.group(1) is not None else m.group(2)
        elif m := _ATTR_EQ.match(term):
            if m.group(1) is not None:
                domain, key, value = m.group(1), m.group(2), m.group(3)
            else:
                value, domain, key = m.group(4), m.group(5), m.group(6)
            if domain != DRIVER:
                return None
        else:
            return None
        if found.setdefault(key, value) != value:
            return None  # two different values: nothing matches; not worth modelling
    return Match(found.get("driver"), found.get("type"), found.get("profile"))


def parse_selectors(v: object) -> Match | None:
    """The conjunction of a selector list (each `{cel: {expression}}`); None when any
    one is not understood."""
    out: Match | None = Match()
    for s in _list(v, "selectors", MAX_SELECTORS):
        cel = _obj(_obj(s, "a selector").get("cel"), "selector.cel")
        out = merge(out, parse_cel(cel.get("expression")))
        if out is None:
            return None
    return out


def merge(a: Match | None, b: Match | None) -> Match | None:
    if a is None or b is None:
        return None
    vals = []
    for x, y in ((a.driver, b.driver), (a.type, b.type), (a.profile, b.profile)):
        if x is not None and y is not None and x != y:
            return None
        vals.append(x if x is not None else y)
    return Match(*vals)


def parse_class(obj: object) -> tuple[str, Match | None]:
    """(name, what its selectors pin down; None: not understood)."""
    _, name, _ = _meta(obj)
    spec = _obj(_obj(obj, "class").get("spec"), "spec")
    return name, parse_selectors(spec.get("selectors"))


# -- ResourceClaim / ResourceClaimTemplate ---------------------------------------------


def _request(r: Mapping[str, object], what: str) -> Request:
    cls = _text(r.get("deviceClassName"), f"{what}.deviceClassName")
    count = r.get("count", 1)
    if not isinstance(count, int) or isinstance(count, bool) or not 0 < count <= MAX_COUNT:
        raise BadDraObject(f"{what}.count is not a count")
    bad = ""
    mode = r.get("allocationMode") or "ExactCount"
    if mode == "All":
        bad = "all_devices"
    elif mode != "ExactCount":
        raise BadDraObject(f"{what}.allocationMode {str(mode)[:40]!r}")
    elif r.get("adminAccess"):
        bad = "admin_access"
    elif r.get("tolerations"):
        bad = "tolerations"
    elif r.get("capacity"):
        bad = "capacity"
    return Request(cls, parse_selectors(r.get("selectors")), count, bad)


def parse_requests(spec: object) -> tuple[Alternatives, ...]:
    """A claim spec's `devices.requests`, each `exactly` or `firstAvailable`."""
    devices = _obj(_obj(spec, "spec").get("devices"), "spec.devices")
    out: list[Alternatives] = []
    for r in _list(devices.get("requests"), "requests", MAX_REQUESTS):
        r = _obj(r, "a request")
        if (exactly := r.get("exactly")) is not None:
            out.append((_request(_obj(exactly, "exactly"), "exactly"),))
        elif (first := r.get("firstAvailable")) is not None:
            subs = _list(first, "firstAvailable", MAX_SUBREQUESTS)
            alts = tuple(_request(_obj(s, "a subrequest"), "firstAvailable") for s in subs)
            if not alts:
                raise BadDraObject("firstAvailable is empty")
            out.append(alts)
        else:
            raise BadDraObject("a request with neither exactly nor firstAvailable")
    return tuple(out)


def parse_claim(obj: object) -> Claim:
    ns, name, uid = _meta(obj)
    o = _obj(obj, "claim")
    status = _obj(o.get("status"), "status")
    alloc = status.get("allocation")
    results = []
    if alloc is not None:
        devs = _obj(_obj(alloc, "allocation").get("devices"), "allocation.devices")
        for r in _list(devs.get("results"), "allocation results", MAX_RESULTS):
            r = _obj(r, "a result")
            results.append(
                (_text(r.get("driver"), "driver"), _text(r.get("pool"), "pool"),
                 _text(r.get("device"), "device"))
            )  # fmt: skip
    reserved = tuple(
        _text(_obj(x, "reservedFor entry").get("uid"), "reservedFor uid")
        for x in _list(status.get("reservedFor"), "reservedFor", MAX_RESERVED_FOR)
    )
    return Claim(ns, name, uid, parse_requests(o.get("spec")), "", tuple(results),
                 alloc is not None, reserved)  # fmt: skip


def parse_template(obj: object) -> tuple[str, tuple[Alternatives, ...]]:
    """("namespace/name", its claim spec's requests)."""
    ns, name, _ = _meta(obj)
    spec = _obj(_obj(obj, "template").get("spec"), "spec")
    return f"{ns}/{name}", parse_requests(spec.get("spec"))


def parse_taint_rule(obj: object) -> TaintRule | None:
    """None for a rule whose effect keeps nothing off a device (`None`)."""
    _meta(obj)
    spec = _obj(_obj(obj, "rule").get("spec"), "spec")
    sel = _obj(spec.get("deviceSelector"), "deviceSelector")
    effect = _obj(spec.get("taint"), "taint").get("effect")
    if effect not in TAINT_EFFECTS:
        return None
    return TaintRule(
        _text(sel.get("driver"), "driver") or None,
        _text(sel.get("pool"), "pool") or None,
        _text(sel.get("device"), "device") or None,
        effect == "NoExecute",
    )


# -- a pod's claims ------------------------------------------------------------------


def pod_claim_refs(pod: Mapping[str, object]) -> tuple[tuple[str, str], ...]:
    """The pod's claims as (claim key, template key): the claim named in the spec, or
    the one generated from its template (pod.status.resourceClaimStatuses), with the
    template to read the requests from while that claim is not yet seen. "" for
    unknown. Empty for a pod without claims (the common case, read cheaply)."""
    spec = pod.get("spec")
    claims = spec.get("resourceClaims") if isinstance(spec, Mapping) else None
    if not claims or not isinstance(claims, list):
        return ()
    meta = pod.get("metadata")
    ns = meta.get("namespace") if isinstance(meta, Mapping) else None
    ns = ns if isinstance(ns, str) else ""
    status = pod.get("status")
    generated: dict[str, str] = {}
    statuses = status.get("resourceClaimStatuses") if isinstance(status, Mapping) else None
    for s in statuses if isinstance(statuses, list) else ():
        if isinstance(s, Mapping) and isinstance(s.get("name"), str):
            cn = s.get("resourceClaimName")
            generated[s["name"]] = cn if isinstance(cn, str) else ""
    out = []
    for c in claims[:MAX_REQUESTS]:
        if not isinstance(c, Mapping):
            continue
        claim, template = c.get("resourceClaimName"), c.get("resourceClaimTemplateName")
        if isinstance(claim, str) and claim:
            out.append((f"{ns}/{claim}", ""))
        elif isinstance(template, str) and template:
            cname = c.get("name")
            gen = generated.get(cname) if isinstance(cname, str) else None
            out.append((f"{ns}/{gen}" if gen else "", f"{ns}/{template}"))
    return tuple(out)


# -- what the watches keep -------------------------------------------------------------

# The key of a kept form (`kept_form`) under which the parsed value sits.
KEPT = "gpudaemon.kept"
_PARSERS: dict[str, Callable[[object], object]] = {
    "resourceslices": parse_slice,
    "resourceclaims": parse_claim,
    "resourceclaimtemplates": parse_template,
    "deviceclasses": parse_class,
    "devicetaintrules": parse_taint_rule,
}


@dataclass(frozen=True, slots=True)
class Unreadable:
    """A kept form's value for an object its parser refused (why, one line): not the
    BadDraObject itself, whose traceback would keep the raw object alive."""

    reason: str


def kept_form(kind: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """The Reflector's transform for a DRA kind: an object becomes its name, namespace,
    UID and resourceVersion, and its parsed value under `KEPT` (`Unreadable` if the
    parser refused it), as each list page or watch event arrives. A tenant's 1.3 MB
    claim is then held as a few hundred bytes, however large its CEL or opaque
    parameters. `read_kept` reads either form."""
    parse = _PARSERS[kind]

    def keep(obj: dict[str, Any]) -> dict[str, Any]:
        try:
            value: object = parse(obj)
        except BadDraObject as e:
            value = Unreadable(e.reason)
        except Exception as e:  # never fails a list: the store counts it as unreadable
            value = Unreadable(f"{type(e).__name__}")
        meta = obj.get("metadata") if isinstance(obj, Mapping) else None
        meta = meta if isinstance(meta, Mapping) else {}
        small = {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion")
                 if isinstance(meta.get(k), str) and len(meta[k]) <= MAX_TEXT}  # fmt: skip
        return {"metadata": small, KEPT: value}

    return keep


def read_kept(obj: object, parse: Callable[[object], Any]) -> Any:
    """`parse(obj)`, or the value a `kept_form` already parsed (BadDraObject again for
    one it refused)."""
    if isinstance(obj, Mapping) and KEPT in obj:
        value = obj[KEPT]
        if isinstance(value, Unreadable):
            raise BadDraObject(value.reason)
        return value
    return parse(obj)
