"""prometheus-client Collectors over the cache. A scrape reads the newest snapshot and
never calls NVML; families are rebuilt from data already in memory.

The agent's registry holds its own metrics and the reading age (`ReadingAgeCollector`)
in one registry and the per-GPU part (`GpuCollector`) beside it; /metrics encodes the
first and appends the second's per-snapshot cached bytes (metrics/http.py)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import MappingProxyType

from loguru import logger
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpudaemon.agent.cache import Cache
from gpudaemon.catalogue import CATALOGUE, PREFIX, MigValue, Series
from gpudaemon.httpserver.exposition import encode_families
from gpudaemon.model import GpuInfo, GpuSample, PodMap, Snapshot

_NO_POD = ("", "", "")
_NO_PODS: PodMap = MappingProxyType({})


def _family(row: Series) -> GaugeMetricFamily | CounterMetricFamily:
    name, labels = row.prometheus_name, list(row.labels)
    if row.kind == "counter":
        return CounterMetricFamily(name.removesuffix("_total"), row.help, labels=labels)
    return GaugeMetricFamily(name, row.help, labels=labels)


class ReadingAgeCollector(Collector):
    """The age of the newest reading: time-dependent, so rendered on every scrape."""

    def __init__(self, cache: Cache, clock: Callable[[], float] = time.time) -> None:
        self.cache = cache
        self.clock = clock

    def describe(self) -> list[Metric]:
        return [self._family(None)]

    def collect(self) -> Iterator[Metric]:
        yield self._family(self.cache.get())

    def _family(self, snap: Snapshot | None) -> GaugeMetricFamily:
        age = GaugeMetricFamily(
            PREFIX + "last_reading_age_seconds",
            "Seconds since the newest telemetry reading was taken.",
        )
        if snap is not None and snap.samples_at:
            age.add_metric([], max(0.0, self.clock() - snap.samples_at))
        return age


class GpuCollector(Collector):
    """Yields the per-GPU families (every row of the catalogue) from the newest Snapshot.

    `pods` must be cheap (it runs inside the scrape): PodAttribution.get returns a
    map refreshed on its own schedule.
    """

    def __init__(self, cache: Cache, node: str, pods: Callable[[], PodMap] | None = None) -> None:
        self.cache = cache
        self.node = node
        self.pods = pods
        # openmetrics? -> (snapshot, pod map, encoded bytes); objects compared by identity
        self._rendered: dict[bool, tuple[Snapshot, PodMap, bytes]] = {}
        # (openmetrics?, row name) -> (its values and labels, its encoded family): a row
        # whose values did not change since the last render (the slow schedules' rows,
        # NVLink's 72 counters per GPU among them) is not encoded again.
        self._families: dict[tuple[bool, str], tuple[object, bytes]] = {}

    def describe(self) -> list[Metric]:
        return []  # unchecked collector: families depend on the cache contents

    def collect(self) -> Iterator[Metric]:
        yield from self.gpu_families(self.cache.get(), self._pods())

    def render_gpus(self, openmetrics: bool) -> bytes:
        """The same families as collect(), already encoded, rendered once per snapshot
        and pod map: between telemetry polls every scrape reuses the bytes."""
        snap, pods = self.cache.get(), self._pods()
        hit = self._rendered.get(openmetrics)
        if hit is not None and hit[0] is snap and hit[1] is pods:
            return hit[2]
        body = self._encode(snap, pods, openmetrics)
        self._rendered[openmetrics] = (snap, pods, body)
        return body

    def _encode(self, snap: Snapshot, pods: PodMap, openmetrics: bool) -> bytes:
        """gpu_families' families encoded, each GPU row's text reused while its values
        and labels are those of the last render (byte for byte the same output)."""
        inv = snap.inventory
        if inv is None:
            return b""
        base = self._base(inv.gpus, pods)
        labels = tuple(tuple(v) for v in base.values())
        samples = [s for s in snap.samples if s.index in base]
        labelsets: dict[tuple[tuple[str, str], ...], str] = {}
        parts: list[bytes] = []
        for row in CATALOGUE:
            if row.gpu is None or row.info is not None:  # info and MIG rows: few series
                fam = next(self._families_of((row,), snap, pods, base, samples))
                parts.append(encode_families((fam,), openmetrics, labelsets))
                continue
            values = tuple((s.index, label, v) for s in samples for label, v in row.gpu(s))
            key = (values, labels)
            hit = self._families.get((openmetrics, row.name))
            if hit is not None and hit[0] == key:
                parts.append(hit[1])
                continue
            fam = next(self._families_of((row,), snap, pods, base, samples))
            text = encode_families((fam,), openmetrics, labelsets)
            self._families[(openmetrics, row.name)] = (key, text)
            parts.append(text)
        return b"".join(parts)

    def gpu_families(self, snap: Snapshot, pods: PodMap) -> Iterator[Metric]:
        """One family per catalogue row, in catalogue order; absent readings are left
        out, never exported as 0."""
        inv = snap.inventory
        if inv is None:
            return
        base = self._base(inv.gpus, pods)
        samples = [s for s in snap.samples if s.index in base]
        yield from self._families_of(CATALOGUE, snap, pods, base, samples)

    def _base(self, gpus: Sequence[GpuInfo], pods: PodMap) -> dict[int, list[str]]:
        """Each GPU's label values: gpu, uuid, model, node, and its pod when attributed."""
        base: dict[int, list[str]] = {}
        for g in gpus:
            ref = pods.get(g.uuid)
            base[g.index] = [
                str(g.index),
                g.uuid,
                g.name,
                self.node,
                *((ref.pod, ref.namespace, ref.container) if ref else _NO_POD),
            ]
        return base

    def _families_of(
        self,
        rows: Iterable[Series],
        snap: Snapshot,
        pods: PodMap,
        base: Mapping[int, list[str]],
        samples: Sequence[GpuSample],
    ) -> Iterator[Metric]:
        inv = snap.inventory
        assert inv is not None
        for row in rows:
            fam = _family(row)
            if row.info is not None:
                for g in inv.gpus:
                    fam.add_metric([*base[g.index], *row.info(inv, g)], 1.0)
            elif row.gpu is not None:
                for s in samples:
                    for label, v in row.gpu(s):
                        fam.add_metric(
                            [*base[s.index], *label.split(",")] if row.label else base[s.index],
                            float(v),
                        )
            elif row.mig is not None:
                self._mig(fam, row.mig, snap, inv.gpus, base, pods)
            yield fam

    def _pods(self) -> PodMap:
        # Always the same empty object: render_gpus' cache compares by identity.
        if self.pods is None:
            return _NO_PODS
        try:
            return self.pods()
        except Exception as e:  # attribution must never fail a scrape
            logger.error("pod attribution lookup failed: {}", e)
            return _NO_PODS

    @staticmethod
    def _mig(
        fam: GaugeMetricFamily | CounterMetricFamily,
        value: MigValue,
        snap: Snapshot,
        gpus: Sequence[GpuInfo],
        base: Mapping[int, list[str]],
        pods: PodMap,
    ) -> None:
        for g in gpus:
            if not g.mig_devices:
                continue
            s = snap.sample_for(g.index)
            by_uuid = {m.uuid: m for m in s.mig} if s else {}
            for d in g.mig_devices:
                v = value(d, by_uuid.get(d.uuid))
                if v is None:
                    continue
                ref = pods.get(d.uuid)
                lab = list(base[g.index][:4])
                lab += (ref.pod, ref.namespace, ref.container) if ref else _NO_POD
                lab += [d.uuid, d.profile, str(d.gpu_instance_id)]
                fam.add_metric(lab, float(v))
