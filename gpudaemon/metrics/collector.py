"""A prometheus-client Collector over the cache. A scrape reads the newest snapshot
and never calls NVML; families are rebuilt from data already in memory."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from types import MappingProxyType

from loguru import logger
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpudaemon.cache import Cache
from gpudaemon.metrics.catalogue import (
    ECC_ERRORS,
    GPU_METRICS,
    HEALTHY,
    LOST,
    PREFIX,
    XID_ERRORS,
)
from gpudaemon.metrics.exposition import encode_families
from gpudaemon.model import GpuInfo, PodMap, Snapshot


class _RenderState(threading.local):
    skip_gpus = False


_render = _RenderState()


@contextmanager
def without_gpus() -> Iterator[None]:
    """In this thread, GpuCollector.collect() yields only the reading age (the HTTP
    layer appends the cached GPU part itself)."""
    _render.skip_gpus = True
    try:
        yield
    finally:
        _render.skip_gpus = False


# Unattributed series carry pod="" etc., which Prometheus stores as "label absent".
GPU_LABELS = ["gpu", "uuid", "model", "node", "pod", "namespace", "container"]
MIG_LABELS = [*GPU_LABELS, "mig_uuid", "mig_profile", "gpu_instance_id"]
_NO_POD = ("", "", "")
_NO_PODS: PodMap = MappingProxyType({})


def _family(
    name: str, kind: str, help_: str, labels: list[str]
) -> GaugeMetricFamily | CounterMetricFamily:
    if kind == "counter":
        return CounterMetricFamily(PREFIX + name.removesuffix("_total"), help_, labels=labels)
    return GaugeMetricFamily(PREFIX + name, help_, labels=labels)


class GpuCollector(Collector):
    """Yields fresh metric families from the newest Snapshot on every scrape.

    `pods` must be cheap (it runs inside the scrape): PodAttribution.get returns a
    map refreshed on its own schedule.
    """

    def __init__(
        self,
        cache: Cache,
        node: str,
        pods: Callable[[], PodMap] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.cache = cache
        self.node = node
        self.pods = pods
        self.clock = clock
        # openmetrics? -> (snapshot, pod map, encoded bytes); objects compared by identity
        self._rendered: dict[bool, tuple[Snapshot, PodMap, bytes]] = {}

    def describe(self) -> list[Metric]:
        return []  # unchecked collector: families depend on the cache contents

    def collect(self) -> Iterator[Metric]:
        snap = self.cache.get()
        yield self.age_family(snap)
        if not _render.skip_gpus:
            yield from self.gpu_families(snap, self._pods())

    def render_gpus(self, openmetrics: bool) -> bytes:
        """The per-GPU part of a scrape, already encoded, rendered once per snapshot
        and pod map: between telemetry polls every scrape reuses the bytes.

        The HTTP layer calls this inside `without_gpus()`, so the registry's own
        pass yields only the (time-dependent) reading age from this collector.
        """
        snap, pods = self.cache.get(), self._pods()
        hit = self._rendered.get(openmetrics)
        if hit is not None and hit[0] is snap and hit[1] is pods:
            return hit[2]
        body = encode_families(self.gpu_families(snap, pods), openmetrics)
        self._rendered[openmetrics] = (snap, pods, body)
        return body

    def age_family(self, snap: Snapshot) -> GaugeMetricFamily:
        age = GaugeMetricFamily(
            PREFIX + "last_reading_age_seconds",
            "Seconds since the newest telemetry reading was taken.",
        )
        if snap.samples_at:
            age.add_metric([], max(0.0, self.clock() - snap.samples_at))
        return age

    def gpu_families(self, snap: Snapshot, pods: PodMap) -> Iterator[Metric]:
        inv = snap.inventory
        if inv is None:
            return
        base: dict[int, list[str]] = {}
        info = GaugeMetricFamily(
            PREFIX + "gpu_info",
            "GPU facts as labels; always 1.",
            labels=[
                *GPU_LABELS,
                "driver_version",
                "cuda_version",
                "pci_bus_id",
                "compute_capability",
                "mig_mode",
            ],
        )
        cuda = ".".join(map(str, inv.cuda_driver_version)) if inv.cuda_driver_version else ""
        for g in inv.gpus:
            ref = pods.get(g.uuid)
            base[g.index] = [
                str(g.index),
                g.uuid,
                g.name,
                self.node,
                *((ref.pod, ref.namespace, ref.container) if ref else _NO_POD),
            ]
            info.add_metric(
                [
                    *base[g.index],
                    inv.driver_version,
                    cuda,
                    g.pci_bus_id,
                    "{}.{}".format(*g.compute_capability),
                    "enabled" if g.mig_enabled else "disabled",
                ],
                1.0,
            )
        yield info

        samples = [s for s in snap.samples if s.index in base]
        for m in GPU_METRICS:
            fam = _family(m.name, m.kind, m.help, GPU_LABELS)
            for s in samples:
                v = getattr(s, m.field)
                if v is not None:
                    fam.add_metric(base[s.index], float(v))
            yield fam

        healthy = _family(HEALTHY.name, HEALTHY.kind, HEALTHY.help, GPU_LABELS)
        lost = _family(LOST.name, LOST.kind, LOST.help, GPU_LABELS)
        ecc = _family(ECC_ERRORS.name, ECC_ERRORS.kind, ECC_ERRORS.help, [*GPU_LABELS, "type"])
        xid = _family(XID_ERRORS.name, XID_ERRORS.kind, XID_ERRORS.help, [*GPU_LABELS, "xid"])
        for s in samples:
            healthy.add_metric(base[s.index], 1.0 if s.healthy else 0.0)
            lost.add_metric(base[s.index], 1.0 if s.lost else 0.0)
            if s.ecc_corrected_errors_total is not None:
                ecc.add_metric([*base[s.index], "corrected"], float(s.ecc_corrected_errors_total))
            if s.ecc_uncorrected_errors_total is not None:
                ecc.add_metric(
                    [*base[s.index], "uncorrected"], float(s.ecc_uncorrected_errors_total)
                )
            for code, n in sorted(s.xid_errors_total.items()):
                xid.add_metric([*base[s.index], str(code)], float(n))
        yield healthy
        yield lost
        yield ecc
        yield xid
        yield from self._mig(snap, inv.gpus, base, pods)

    def _pods(self) -> PodMap:
        # Always the same empty object: render_gpus' cache compares by identity.
        if self.pods is None:
            return _NO_PODS
        try:
            return self.pods()
        except Exception as e:  # attribution must never fail a scrape
            logger.error("pod attribution lookup failed: {}", e)
            return _NO_PODS

    def _mig(
        self,
        snap: Snapshot,
        gpus: Sequence[GpuInfo],
        base: Mapping[int, list[str]],
        pods: PodMap,
    ) -> Iterator[Metric]:
        used = GaugeMetricFamily(
            PREFIX + "mig_memory_used_bytes", "Memory in use on a MIG instance.", labels=MIG_LABELS
        )
        total = GaugeMetricFamily(
            PREFIX + "mig_memory_total_bytes", "Memory of a MIG instance.", labels=MIG_LABELS
        )
        for g in gpus:
            if not g.mig_devices:
                continue
            s = snap.sample_for(g.index)
            by_uuid = {m.uuid: m for m in s.mig} if s else {}
            for d in g.mig_devices:
                ref = pods.get(d.uuid)
                lab = list(base[g.index][:4])
                lab += (ref.pod, ref.namespace, ref.container) if ref else _NO_POD
                lab += [d.uuid, d.profile, str(d.gpu_instance_id)]
                total.add_metric(lab, float(d.memory_total_bytes))
                ms = by_uuid.get(d.uuid)
                if ms is not None and ms.memory_used_bytes is not None:
                    used.add_metric(lab, float(ms.memory_used_bytes))
        yield used
        yield total
