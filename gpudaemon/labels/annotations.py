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
from dataclasses import dataclass

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
        self.key = prefix + "gpus"
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
        held("temperature_c", s.temperature_celsius, q.temperature_band_c, q.temperature_step_c)
        entry["healthy"] = s.healthy
        if not s.healthy:
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
            self._tracks[(uuid, key)] = _Track(raw, raw, _round(raw, step))
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
    memory_used_mib: int | None = None
    utilization_pct: int | None = None
    temperature_c: int | None = None
    processes: int | None = None
    mig_devices: int | None = None
    # `namespace/name` of the pods holding the GPU or one of its MIG devices.
    pods: tuple[str, ...] = ()


def decode_gpus(text: str) -> list[GpuState]:
    """The annotation's entries; ValueError if it is not a JSON list. Entries that are
    malformed (written by someone else, or a future format) are skipped, not guessed."""
    entries = json.loads(text)
    if not isinstance(entries, list):
        raise ValueError("the gpus annotation is not a JSON list")
    out = []
    for e in entries:
        if not isinstance(e, dict):
            continue
        index, total = _opt_int(e.get("index")), _opt_int(e.get("memory_total_mib"))
        uuid = e.get("uuid")
        if index is None or total is None or not isinstance(uuid, str):
            continue
        out.append(
            GpuState(
                index=index,
                uuid=uuid,
                memory_total_mib=total,
                healthy=e.get("healthy") is not False,
                reason=str(e.get("reason") or ""),
                memory_used_mib=_opt_int(e.get("memory_used_mib")),
                utilization_pct=_opt_int(e.get("utilization_pct")),
                temperature_c=_opt_int(e.get("temperature_c")),
                processes=_opt_int(e.get("processes")),
                mig_devices=_opt_int(e.get("mig_devices")),
                pods=_holders(e),
            )
        )
    return out


def _holders(e: dict[str, object]) -> tuple[str, ...]:
    out = [p for p in (e.get("pods") or []) if isinstance(p, str) and p]  # type: ignore[attr-defined]
    for m in e.get("mig") or []:  # type: ignore[attr-defined]
        if isinstance(m, dict) and isinstance(m.get("pod"), str) and m["pod"]:
            out.append(m["pod"])
    return tuple(dict.fromkeys(out))


def _opt_int(v: object) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None
