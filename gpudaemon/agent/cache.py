"""The in-memory cache: poll once, read many.

Jobs publish immutable Snapshots; readers (labelers, the metrics collector, the
InfluxDB writer, the NFD writer) take the current one without locking.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace

from gpudaemon.model import GpuSample, NodeInventory, Snapshot


class Cache:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()  # serialises writers only
        self._snapshot = Snapshot()

    def get(self) -> Snapshot:
        return self._snapshot  # attribute reads are atomic; the object is immutable

    def put_inventory(self, inventory: NodeInventory) -> Snapshot:
        with self._lock:
            self._snapshot = replace(
                self._snapshot, inventory=inventory, inventory_at=self._clock()
            )
            return self._snapshot

    def put_samples(self, samples: tuple[GpuSample, ...]) -> Snapshot:
        with self._lock:
            s = self._snapshot
            self._snapshot = replace(
                s,
                samples=_with_energy(samples, s.energy_joules),
                samples_at=self._clock(),
                sample_seq=s.sample_seq + 1,
            )
            return self._snapshot

    def put_energy(self, energy: Mapping[int, float | None]) -> Snapshot:
        """A read of the energy counters. A GPU whose read failed keeps its last value,
        so the counter neither vanishes nor goes back (a Prometheus counter must not)."""
        with self._lock:
            s = self._snapshot
            merged = {**s.energy_joules, **{i: v for i, v in energy.items() if v is not None}}
            self._snapshot = replace(
                s,
                samples=_with_energy(s.samples, merged),
                energy_joules=merged,
                energy_at=self._clock(),
            )
            return self._snapshot

    def age_seconds(self) -> float | None:
        """Age of the newest telemetry reading, or None before the first poll."""
        at = self._snapshot.samples_at
        return None if at == 0.0 else max(0.0, self._clock() - at)


def _with_energy(
    samples: tuple[GpuSample, ...], energy: Mapping[int, float]
) -> tuple[GpuSample, ...]:
    """Samples carry the newest energy read of their GPU (a lost GPU reports none)."""
    if not energy:
        return samples
    return tuple(
        replace(x, energy_joules_total=energy[x.index])
        if not x.lost and x.index in energy and x.energy_joules_total != energy[x.index]
        else x
        for x in samples
    )
