"""The `<prefix>gpus` annotation: compact per-GPU state for schedulers.

Readings are smoothed (EWMA across reconciles), then quantized with hysteresis: a
published value moves only when the smoothed reading has moved a whole band away
from the smoothed value it was published from. Plain rounding flaps at a bucket edge
under noise and rewrites the Node; a band on raw readings still flips on the odd
3-sigma spike; both together do not. The first value comes from a single noisy
reading, so until smoothing has settled (`warmup_readings`) the band is twice as wide,
and then every value is re-based once on its smoothed value: at most one settling
write per node, after which only real changes move the annotation.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import orjson

from gpudaemon.errors import BadValueError
from gpudaemon.labels.keys import GPUS_ANNOTATION
from gpudaemon.model import MIB, GpuSample, MigDevice, PodMap, Snapshot

ANNOTATION_BUDGET_BYTES = 256 * 1024


@dataclass(frozen=True)
class Quantization:
    utilization_step_pct: int = 10
    utilization_band_pct: int = 15
    memory_step_mib: int = 1024
    memory_band_ratio: float = 0.10  # of the GPU's total memory
    temperature_step_c: int = 5
    temperature_band_c: int = 8
    # Weight of the newest reading; 0.3 cuts noise ~2.4x yet follows a step in 1-2 cycles.
    smoothing: float = 0.3
    # Reconciles before the one settling re-base: ~5 min at the default 30 s schedule.
    warmup_readings: int = 10


@dataclass
class _Track:
    """One reading of one GPU: its smoothed value and what was published from it."""

    smoothed: float
    anchor: float  # the smoothed value `published` was rounded from
    published: int
    readings: int = 1

    def update(self, raw: float, q: Quantization, band: float, step: int) -> int:
        self.smoothed += q.smoothing * (raw - self.smoothed)
        self.readings += 1
        if self.readings == q.warmup_readings:
            # Settle once: re-base on the smoothed value, so a noisy first reading
            # cannot cause rewrites later. At most one write per node, at this reconcile.
            self.anchor, self.published = self.smoothed, _round(self.smoothed, step)
            return self.published
        width = band * 2 if self.readings < q.warmup_readings else band
        if abs(self.smoothed - self.anchor) >= width:
            self.anchor, self.published = self.smoothed, _round(self.smoothed, step)
        return self.published


def _mig_entry(m: MigDevice, pods: PodMap | None) -> dict[str, object]:
    """A MIG device: its profile, memory and, when a pod holds it, which (the kubelet's
    pod-resources answer; without it, `pod` is absent, not "free")."""
    out: dict[str, object] = {
        "uuid": m.uuid,
        "profile": m.profile,
        "gi": m.gpu_instance_id,
        "memory_total_mib": m.memory_total_mib,
    }
    if pods is not None:
        ref = pods.get(m.uuid)
        out["pod"] = f"{ref.namespace}/{ref.pod}" if ref is not None else ""
    return out


def _round(v: float, step: int) -> int:
    return int(round(v / step) * step)


class GpuStateAnnotator:
    """Stateful: remembers what it last published so noise cannot move it."""

    def __init__(self, prefix: str, q: Quantization | None = None) -> None:
        self.key = prefix + GPUS_ANNOTATION
        self.q = q or Quantization()
        self._tracks: dict[tuple[str, str], _Track] = {}

    def annotations(self, snap: Snapshot, pods: PodMap | None = None) -> dict[str, str]:
        if snap.inventory is None:
            return {}
        entries = []
        for info in snap.inventory.gpus:
            s = snap.sample_for(info.index)
            entry = self._entry(info.index, info.uuid, info.memory_total_bytes, s)
            if pods is not None and (ref := pods.get(info.uuid)) is not None:
                # Who holds the GPU (kubelet pod-resources), for the rebalancer to drain
                # a sick GPU; absent when no pod does or the agent cannot ask.
                entry["pods"] = [f"{ref.namespace}/{ref.pod}"]
            if info.mig_enabled:
                entry["mig_devices"] = len(info.mig_devices)
                entry["mig"] = [_mig_entry(m, pods) for m in info.mig_devices]
            entries.append(entry)
        text = json.dumps(entries, separators=(",", ":"), sort_keys=False)
        if len(text) > ANNOTATION_BUDGET_BYTES:  # pragma: no cover - needs >1000 GPUs
            raise ValueError(f"{self.key} annotation is {len(text)} bytes, over budget")
        return {self.key: text}

    def _entry(
        self, index: int, uuid: str, total_bytes: int, s: GpuSample | None
    ) -> dict[str, object]:
        q = self.q
        total_mib = total_bytes // MIB
        entry: dict[str, object] = {"index": index, "uuid": uuid, "memory_total_mib": total_mib}
        if s is None:
            entry["healthy"] = True
            return entry

        def held(key: str, raw: float | None, band: float, step: int) -> None:
            v = self._held(uuid, key, raw, band, step)
            if v is not None:
                entry[key] = v

        used = s.memory_used_bytes / MIB if s.memory_used_bytes is not None else None
        held("memory_used_mib", used, total_mib * q.memory_band_ratio, q.memory_step_mib)
        util = s.gpu_utilization_ratio * 100 if s.gpu_utilization_ratio is not None else None
        held("utilization_pct", util, q.utilization_band_pct, q.utilization_step_pct)
        # GPM's SM activity (Hopper+), held like utilization: tells a busy GPU from one
        # that merely has a process. Absent without GPM.
        sm = s.gpm.sm_active_ratio if s.gpm is not None else None
        held(
            "sm_active_pct",
            sm * 100 if sm is not None else None,
            q.utilization_band_pct,
            q.utilization_step_pct,
        )
        held("temperature_c", s.temperature_celsius, q.temperature_band_c, q.temperature_step_c)
        # The verdict (health/verdict.py): it changes only when a signal does (clock
        # events hold it for minutes), so it never rewrites the Node with noise.
        entry["healthy"] = s.healthy  # kept for readers older than `state`
        entry["state"] = s.health_state
        entry["action"] = s.health_action
        if s.health_state != "healthy":
            entry["reason"] = s.health_reason
        if s.process_count is not None:
            entry["processes"] = s.process_count
        return entry

    def _held(self, uuid: str, key: str, raw: float | None, band: float, step: int) -> int | None:
        if raw is None:  # unsupported now: forget it, so it starts afresh if it returns
            self._tracks.pop((uuid, key), None)
            return None
        track = self._tracks.get((uuid, key))
        if track is None:
            # A reading that appears later during the GPU's warm-up (GPM's SM activity:
            # from the second poll) takes its count, so it settles at the same reconcile
            # as the others: one settling write per node still.
            age = max((t.readings for (u, _), t in self._tracks.items() if u == uuid), default=1)
            age = age if age < self.q.warmup_readings else 1
            self._tracks[(uuid, key)] = _Track(raw, raw, _round(raw, step), age)
            return _round(raw, step)
        return track.update(raw, self.q, band, step)


@dataclass(frozen=True)
class GpuState:
    """One entry of the `<prefix>gpus` annotation, as a reader (the extender) sees it.
    Readings the agent could not take are None, never 0."""

    index: int
    uuid: str
    memory_total_mib: int
    healthy: bool = True
    reason: str = ""
    # The verdict; an older agent writes neither: state then follows `healthy`, and
    # action is "" (not known).
    state: str = "healthy"
    action: str = ""
    memory_used_mib: int | None = None
    utilization_pct: int | None = None
    sm_active_pct: int | None = None  # GPM (Hopper+); None: no GPM
    temperature_c: int | None = None
    processes: int | None = None
    mig_devices: int | None = None
    # `namespace/name` of the pods holding the GPU or one of its MIG devices.
    pods: tuple[str, ...] = ()


# -- reading what another program wrote ------------------------------------------------
#
# Every node's agent identity may write its own annotations and labels, so a reader (the
# extender, the rebalancer, `status`) treats them as hostile: a size cap before parsing,
# a depth cap without recursion, entry caps, and a type and range check for every field
# it reads. Anything else is one `BadValueError`, and that node has no data.

# What the agent writes for 8 GPUs x 7 MIG devices, each held by a pod whose namespace
# and name are as long as Kubernetes allows, every GPU unhealthy with a long reason:
# 29.1 KiB (tests/unit/test_untrusted.py measures it; 20 KiB of it is pod names). 64 KiB
# is over twice that, and a quarter of the API server's 256 KiB for all annotations.
GPUS_MAX_BYTES = 64 * 1024
MAX_GPUS = 64
MAX_MIG_PER_GPU = 16  # 7 on every MIG-capable GPU so far
MAX_PODS_PER_GPU = 16
# The schema nests 4 deep (the list, a GPU, its `mig` list, a MIG device); two spare
# levels, so a field a newer agent adds does not make every node unreadable to an older
# extender during a rolling upgrade.
MAX_DEPTH = 6
MAX_TEXT = 1024  # a reason, a UUID, a profile
MAX_POD_REF = 63 + 1 + 253  # namespace/name
_INT_LIMIT = 2**53  # integers beyond this are not readings
_STATES = ("healthy", "degraded", "unhealthy")  # health/verdict.py STATES
_ACTION = re.compile(r"[a-z][a-z0-9_]{0,31}")
COUNT_LABEL_MAX = 4096  # gpu.count and friends: 64 GPUs x 7 MIG devices is 448

# A JSON string, to its closing quote or the end of the text; possessive, so an
# unterminated one costs one pass, not one per quote after it.
_STRING = re.compile(r'"[^"\\]*+(?:\\.[^"\\]*+)*+(?:"|\\?\Z)', re.S)
_BRACKETS = re.compile(r"[^\[\]{}]+")


def bounded_json(text: object, key: str, max_bytes: int, max_depth: int = MAX_DEPTH) -> object:
    """`text` parsed as JSON, or `BadValueError`: over `max_bytes`, nested deeper than
    `max_depth` (found by a scan of its brackets, not by recursion), or not JSON (NaN,
    Infinity, lone surrogates and numbers that overflow a double are not JSON to orjson).
    Never any other exception, and bounded time: the caps are checked before parsing."""
    if not isinstance(text, str):
        raise BadValueError(key, f"not a string ({type(text).__name__})")
    if len(text) > max_bytes:
        raise BadValueError(key, f"over {max_bytes} bytes")
    try:
        raw = text.encode("utf-8")
    except UnicodeEncodeError:
        raise BadValueError(key, "not valid UTF-8") from None
    if len(raw) > max_bytes:
        raise BadValueError(key, f"over {max_bytes} bytes")
    if json_depth(text, max_depth) > max_depth:
        raise BadValueError(key, f"nested deeper than {max_depth}")
    try:
        return orjson.loads(raw)
    except (orjson.JSONDecodeError, RecursionError, MemoryError) as e:
        raise BadValueError(key, f"not JSON ({str(e)[:80]})") from None


def json_depth(text: str, stop_at: int) -> int:
    """How deep `text`'s brackets nest outside strings, counted up to `stop_at` + 1; a
    loop over the brackets alone (C regexes drop the rest), so it cannot recurse and
    costs little on a legitimate value."""
    depth = deepest = 0
    for c in _BRACKETS.sub("", _STRING.sub("", text)):
        if c in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > stop_at:
                    break
        else:
            depth -= 1
    return deepest


def count_label(value: object, key: str, limit: int = COUNT_LABEL_MAX) -> int:
    """A count label (`gpu.count`, `gpu.healthy`, ...): decimal digits, 0..`limit`."""
    if not isinstance(value, str) or not value.isascii() or not value.isdigit():
        raise BadValueError(key, "not a whole number")
    if len(value) > 6 or int(value) > limit:
        raise BadValueError(key, f"over {limit}")
    return int(value)


def decode_gpus(text: object, key: str = "gpus") -> list[GpuState]:
    """The annotation's entries, or `BadValueError` (the only exception it raises) when
    the value is over a cap or any field the readers use has the wrong type or range: a
    partly read node could hide the one unhealthy GPU, so it is all or nothing. Fields
    this version does not know are ignored (a newer agent's)."""
    doc = bounded_json(text, key, GPUS_MAX_BYTES)
    if not isinstance(doc, list):
        raise BadValueError(key, "not a JSON list")
    if len(doc) > MAX_GPUS:
        raise BadValueError(key, f"more than {MAX_GPUS} GPUs")
    out = []
    indexes: set[int] = set()
    uuids: set[str] = set()
    for e in doc:
        g = _gpu(e, key)
        if g.index in indexes or g.uuid in uuids:
            raise BadValueError(key, f"GPU {g.index} listed twice")
        indexes.add(g.index)
        uuids.add(g.uuid)
        out.append(g)
    return out


def _gpu(e: object, key: str) -> GpuState:
    if not isinstance(e, dict):
        raise BadValueError(key, "a GPU entry is not an object")
    f = _Fields(e, key)
    index = f.need("index", 0, 1023)
    mig = f.array("mig", MAX_MIG_PER_GPU)
    holders = [p for p in f.strings("pods", MAX_PODS_PER_GPU, MAX_POD_REF) if p]
    for m in mig:
        if not isinstance(m, dict):
            raise BadValueError(key, f"GPU {index}: a MIG entry is not an object")
        mf = _Fields(m, key)
        mf.text("uuid", MAX_TEXT)
        mf.text("profile", MAX_TEXT)
        mf.integer("gi", 0, 1023)
        mf.integer("memory_total_mib", 0, _INT_LIMIT)
        if pod := mf.text("pod", MAX_POD_REF):
            holders.append(pod)
    healthy = e.get("healthy", True)
    if not isinstance(healthy, bool):
        raise BadValueError(key, f"GPU {index}: healthy is not true or false")
    state = f.text("state", 16) or ("healthy" if healthy else "unhealthy")
    if state not in _STATES:
        raise BadValueError(key, f"GPU {index}: state is not one of {', '.join(_STATES)}")
    if (state == "unhealthy") == healthy:
        raise BadValueError(key, f"GPU {index}: state {state} contradicts healthy={healthy}")
    action = f.text("action", 32)
    if action and not _ACTION.fullmatch(action):  # a newer agent's action is kept as is
        raise BadValueError(key, f"GPU {index}: action is not a lower-case word")
    return GpuState(
        index=index,
        uuid=f.text("uuid", MAX_TEXT, required=True),
        memory_total_mib=f.need("memory_total_mib", 0, _INT_LIMIT),
        healthy=healthy,
        reason=f.text("reason", MAX_TEXT),
        state=state,
        action=action,
        memory_used_mib=f.integer("memory_used_mib", 0, _INT_LIMIT),
        utilization_pct=f.integer("utilization_pct", 0, 100),
        sm_active_pct=f.integer("sm_active_pct", 0, 100),
        temperature_c=f.integer("temperature_c", -300, 1000),
        processes=f.integer("processes", 0, _INT_LIMIT),
        mig_devices=f.integer("mig_devices", 0, MAX_MIG_PER_GPU),
        pods=tuple(dict.fromkeys(holders)),
    )


class _Fields:
    """Typed reads of one JSON object's fields; a wrong type or range is BadValueError
    naming the field. Absent (or null) optional fields read as None or empty."""

    def __init__(self, obj: dict[str, object], key: str) -> None:
        self.obj, self.key = obj, key

    def _bad(self, name: str, what: str) -> BadValueError:
        return BadValueError(self.key, f"field {name!r} {what}")

    def _get(self, name: str, required: bool) -> object:
        v = self.obj.get(name)
        if v is None and required:
            raise self._bad(name, "is missing")
        return v

    def need(self, name: str, lo: int, hi: int) -> int:
        v = self.integer(name, lo, hi, required=True)
        assert v is not None
        return v

    def integer(self, name: str, lo: int, hi: int, *, required: bool = False) -> int | None:
        v = self._get(name, required)
        if v is None:
            return None
        if not isinstance(v, int) or isinstance(v, bool):
            raise self._bad(name, "is not an integer")
        if not lo <= v <= hi:
            raise self._bad(name, f"is outside {lo}..{hi}")
        return v

    def text(self, name: str, limit: int, *, required: bool = False) -> str:
        v = self._get(name, required)
        if v is None:
            return ""
        if not isinstance(v, str):
            raise self._bad(name, "is not a string")
        if len(v) > limit or (required and not v):
            raise self._bad(name, f"is empty or over {limit} characters")
        return v

    def array(self, name: str, limit: int) -> list[object]:
        v = self._get(name, False)
        if v is None:
            return []
        if not isinstance(v, list):
            raise self._bad(name, "is not a list")
        if len(v) > limit:
            raise self._bad(name, f"has more than {limit} entries")
        return v

    def strings(self, name: str, limit: int, each: int) -> list[str]:
        out = self.array(name, limit)
        if not all(isinstance(s, str) and len(s) <= each for s in out):
            raise self._bad(name, f"holds something other than strings of up to {each}")
        return out  # type: ignore[return-value]
