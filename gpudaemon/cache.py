"""The in-memory cache: poll once, read many.

Jobs publish immutable Snapshots; readers (labelers, the metrics collector, the
InfluxDB writer, the NFD writer) take the current one without locking.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
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
                s, samples=samples, samples_at=self._clock(), sample_seq=s.sample_seq + 1
            )
            return self._snapshot

    def age_seconds(self) -> float | None:
        """Age of the newest telemetry reading, or None before the first poll."""
        at = self._snapshot.samples_at
        return None if at == 0.0 else max(0.0, self._clock() - at)
