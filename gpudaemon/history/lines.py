"""InfluxDB line protocol for GPU snapshots: one point per GPU (and per MIG instance),
fields from the catalogue of per-GPU series."""

from __future__ import annotations

import math

from gpudaemon import catalogue
from gpudaemon.model import Snapshot

MEASUREMENT = catalogue.GPU_MEASUREMENT


def _escape(s: str, specials: str) -> str:
    s = s.replace("\\", "\\\\").replace("\n", " ")
    for c in specials:
        s = s.replace(c, "\\" + c)
    return s


def _field_value(v: int | float) -> str | None:
    if isinstance(v, int):
        return f"{v}i"
    return repr(v) if math.isfinite(v) else None  # line protocol has no NaN/Inf


def encode_line(
    measurement: str, tags: dict[str, str], fields: dict[str, int | float], ts_ms: int
) -> str:
    """One point of line protocol. Written here rather than via influxdb_client.Point,
    which is untyped and would hide int/float mix-ups that InfluxDB rejects as a
    field type conflict."""
    tag_part = "".join(
        f",{_escape(k, ',= ')}={_escape(v, ',= ')}" for k, v in sorted(tags.items()) if v
    )
    field_part = ",".join(
        f"{_escape(k, ',= ')}={fv}"
        for k, v in fields.items()
        if (fv := _field_value(v)) is not None
    )
    return f"{_escape(measurement, ', ')}{tag_part} {field_part} {ts_ms}"


def lines_for(snap: Snapshot, node: str) -> list[str]:
    """Line protocol for one snapshot: one point per GPU and one per MIG instance, a
    field per catalogue row (gpudaemon/catalogue/). Unsupported readings are left
    out, never written as 0."""
    inv = snap.inventory
    if inv is None or not snap.samples or not snap.samples_at:
        return []
    gpus = {g.index: g for g in inv.gpus}
    ts_ms = round(snap.samples_at * 1000)
    gpu_rows, mig_rows = catalogue.rows("gpu"), catalogue.rows("mig")
    out = []
    for s in snap.samples:
        info = gpus.get(s.index)
        tags = {
            "node": node,
            "gpu": str(s.index),
            "uuid": s.uuid,
            "model": info.name if info else "unknown",
        }
        fields: dict[str, int | float] = {}
        for row in gpu_rows:
            fields.update(catalogue.influx_fields(row, s))
        out.append(encode_line(catalogue.GPU_MEASUREMENT, tags, fields, ts_ms))
        if info is None or not info.mig_devices:
            continue
        by_uuid = {m.uuid: m for m in s.mig}
        for d in info.mig_devices:
            mig_tags = {
                **tags,
                "mig_uuid": d.uuid,
                "mig_profile": d.profile,
                "gpu_instance_id": str(d.gpu_instance_id),
            }
            mig_fields: dict[str, int | float] = {}
            for row in mig_rows:
                mig_fields.update(catalogue.mig_influx_fields(row, d, by_uuid.get(d.uuid)))
            if mig_fields:
                out.append(encode_line(catalogue.MIG_MEASUREMENT, mig_tags, mig_fields, ts_ms))
    return out
