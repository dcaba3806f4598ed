"""InfluxDB line protocol for GPU snapshots: one point per GPU, fields from the
metric catalogue."""

from __future__ import annotations

import math
import typing

from gpudaemon.metrics.catalogue import GPU_METRICS, HEALTHY, XID_ERRORS
from gpudaemon.model import GpuSample, Snapshot

MEASUREMENT = "gpu"

_INT_FIELDS = frozenset(
    name for name, hint in typing.get_type_hints(GpuSample).items() if "int" in str(hint)
)


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
    """Line protocol for one snapshot: one point per GPU, fields from the catalogue.
    Unsupported readings are left out, never written as 0."""
    inv = snap.inventory
    if inv is None or not snap.samples or not snap.samples_at:
        return []
    models = {g.index: g.name for g in inv.gpus}
    ts_ms = round(snap.samples_at * 1000)
    out = []
    for s in snap.samples:
        tags = {
            "node": node,
            "gpu": str(s.index),
            "uuid": s.uuid,
            "model": models.get(s.index, "unknown"),
        }
        fields: dict[str, int | float] = {}
        for m in GPU_METRICS:
            v = getattr(s, m.field)
            if v is not None:
                fields[m.influx_field] = int(v) if m.field in _INT_FIELDS else float(v)
        fields[HEALTHY.influx_field] = 1 if s.healthy else 0
        if s.ecc_corrected_errors_total is not None:
            fields["ecc_corrected_errors_total"] = int(s.ecc_corrected_errors_total)
        if s.ecc_uncorrected_errors_total is not None:
            fields["ecc_uncorrected_errors_total"] = int(s.ecc_uncorrected_errors_total)
        # An empty map is a real count (no XIDs seen), not an unsupported reading.
        fields[XID_ERRORS.influx_field] = int(sum(s.xid_errors_total.values()))
        out.append(encode_line(MEASUREMENT, tags, fields, ts_ms))
    return out
