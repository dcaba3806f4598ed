"""The catalogue drives both exports: a Prometheus series and its InfluxDB field must
not drift apart, and no reading of a GpuSample may be exported one way only."""

from __future__ import annotations

import dataclasses
import re

import pytest
from prometheus_client import CollectorRegistry

from gpudaemon import catalogue
from gpudaemon.agent.cache import Cache
from gpudaemon.agent.metrics.collector import GpuCollector
from gpudaemon.history.lines import lines_for
from gpudaemon.model import (
    MIB,
    GpmReading,
    GpuInfo,
    GpuSample,
    MigDevice,
    MigSample,
    NodeInventory,
    Snapshot,
)
from tests.unit.metrics.test_collector import FULL as COLLECTOR_FULL

MIG = MigDevice("MIG-a", "1g.10gb", 1, 0, 9856 * MIB)
GPU = GpuInfo(
    0, "GPU-0", "NVIDIA A100", 40 * 1024 * MIB, (8, 0), mig_enabled=True, mig_devices=(MIG,)
)
# Every reading set (the collector tests' sample), unhealthy, with one MIG instance.
FULL = dataclasses.replace(
    COLLECTOR_FULL,
    healthy=False,
    health_reason="xid 79",
    mig=(
        MigSample(
            "MIG-a",
            memory_used_bytes=7 * MIB,
            memory_total_bytes=9856 * MIB,
            gpm=GpmReading(
                sm_active_ratio=0.3,
                sm_occupancy_ratio=0.1,
                tensor_active_ratio=0.2,
                dram_active_ratio=0.15,
                fp64_active_ratio=0.01,
            ),
        ),
    ),
)
# Not readings: identity (tags/labels), the human-readable reason, the MIG readings
# (checked through the MIG rows).
NOT_READINGS = {"index", "uuid", "health_reason", "mig"}


def _snapshot(sample: GpuSample) -> Snapshot:
    cache = Cache(clock=lambda: 100.0)
    cache.put_inventory(NodeInventory("550.54.15", (12, 4), (GPU,)))
    return cache.put_samples((sample,))


def _prometheus(snap: Snapshot) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    cache = Cache()
    assert snap.inventory is not None
    cache.put_inventory(snap.inventory)
    cache.put_samples(snap.samples)
    reg = CollectorRegistry()
    reg.register(GpuCollector(cache, "n"))
    out = {}
    for fam in reg.collect():
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _influx(snap: Snapshot) -> dict[tuple[str, str], float]:
    """(measurement, field) -> value, for the one GPU and its MIG instance."""
    out = {}
    for line in lines_for(snap, "n"):
        head, fields, _ts = re.split(r"(?<!\\) ", line)
        measurement = head.split(",")[0]
        for f in fields.split(","):
            k, v = f.split("=")
            out[(measurement, k)] = float(v.removesuffix("i"))
    return out


def _metric(
    prom: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **want: str
) -> list[float]:
    return [
        v
        for (n, labels), v in prom.items()
        if n == name and all(dict(labels).get(k) == w for k, w in want.items())
    ]


def test_every_row_is_in_influxdb_or_says_why_not() -> None:
    for row in catalogue.CATALOGUE:
        assert row.influx_field or row.influx_note, row.name
        assert (row.scope == "info") == (row.info is not None), row.name
        assert row.kind != "counter" or row.name.endswith("_total"), row.name


def test_each_metric_and_its_influxdb_field_carry_the_same_value() -> None:
    snap = _snapshot(FULL)
    prom, influx = _prometheus(snap), _influx(snap)
    seen = set()
    for row in catalogue.CATALOGUE:
        name = catalogue.PREFIX + row.name
        if not row.influx_field:
            assert _metric(prom, name), row.name
            continue
        if row.scope == "mig":
            key = (catalogue.MIG_MEASUREMENT, row.influx_field)
            assert _metric(prom, name, mig_uuid="MIG-a") == [influx[key]], row.name
        elif row.influx_sum:
            key = (catalogue.GPU_MEASUREMENT, row.influx_field)
            assert sum(_metric(prom, name)) == influx[key] > 0, row.name
        elif row.label:
            for label, _ in row.gpu(FULL) if row.gpu else ():
                key = (catalogue.GPU_MEASUREMENT, row.influx_field.format(label))
                assert _metric(prom, name, **{row.label: label}) == [influx[key]], row.name
                seen.add(key)
            continue
        else:
            key = (catalogue.GPU_MEASUREMENT, row.influx_field)
            assert _metric(prom, name) == [influx[key]], row.name
        seen.add(key)
    assert seen == set(influx), "InfluxDB has fields no metric explains"


@pytest.mark.parametrize(
    "field", [f.name for f in dataclasses.fields(GpuSample) if f.name not in NOT_READINGS]
)
def test_every_reading_reaches_both_exports(field: str) -> None:
    """Change one reading: both the scrape and the InfluxDB point must change. A new
    GpuSample field without a catalogue row fails here."""
    old = getattr(FULL, field)
    if isinstance(old, bool):
        new: object = not old
    elif field == "health_state":
        new = "unhealthy" if old != "unhealthy" else "healthy"
    elif field == "health_action":
        new = "replace"
    elif field == "recovery_action":
        new = "node_reboot"
    elif field == "clock_events_active":
        new = frozenset({"hw_power_brake"})
    elif field == "nvlink_errors_total":
        new = {**old, 7: {"recovery": 9}}
    elif field == "clock_event_seconds_total":
        new = {**old, "hw_power_brake": 2.0}
    elif field == "gpm":
        new = dataclasses.replace(old, sm_active_ratio=0.9, pcie_bytes_total={"tx": 31})
    elif isinstance(old, dict):
        new = {**old, 48: 1}
    else:
        new = old * 2
    # FULL is unhealthy: a state other than "unhealthy" needs healthy=True with it.
    extra = {"healthy": True} if field == "health_state" and new != "unhealthy" else {}
    changed = _snapshot(dataclasses.replace(FULL, **{field: new, **extra}))
    base = _snapshot(FULL)
    assert _prometheus(changed) != _prometheus(base), f"{field}: not in Prometheus"
    assert _influx(changed) != _influx(base), f"{field}: not in InfluxDB"


def test_mig_readings_reach_both_exports() -> None:
    more = dataclasses.replace(FULL, mig=(MigSample("MIG-a", memory_used_bytes=8 * MIB),))
    assert _prometheus(_snapshot(more)) != _prometheus(_snapshot(FULL))
    assert _influx(_snapshot(more)) != _influx(_snapshot(FULL))
