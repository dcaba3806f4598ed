"""Poll once, read many: the agent's polling steps, from a backend into the cache.
Every reader (labels, /metrics, history) reads the cache, never the backend.

Kept apart from the wiring (app.py) so that bench/poll times the very steps the agent
runs, with the library modules only."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gpudaemon.agent.cache import Cache
from gpudaemon.agent.healthlog import HealthLog
from gpudaemon.agent.healthmemory import HealthMemory
from gpudaemon.backends import Backend
from gpudaemon.health.verdict import HealthJudge
from gpudaemon.model import GpuSample


class Poller:
    def __init__(
        self, backend: Backend, cache: Cache, health_memory: HealthMemory | None = None
    ) -> None:
        self.backend = backend
        self.cache = cache
        self.health_memory = health_memory
        self.health_log = HealthLog()  # one line when a GPU fault starts, one when it ends
        self.health_judge = HealthJudge()  # the verdict rows that need history (rates)
        # Last, the GPU reset's view (remediation.reset_gpu): in reset, or escalated.
        self.remediation: Callable[[Sequence[GpuSample]], tuple[GpuSample, ...]] | None = None

    def inventory(self) -> None:
        self.cache.put_inventory(self.backend.inventory())

    def telemetry(self) -> None:
        if self.cache.get().inventory is None:
            self.inventory()
        samples = self.health_judge.apply(self.backend.sample())
        if self.health_memory is not None:  # sticky faults survive a restart
            samples = self.health_memory.apply(samples)
        if self.remediation is not None:
            samples = self.remediation(samples)
        self.health_log.observe(self.cache.put_samples(samples).samples)

    def health_counters(self) -> None:
        """The slower health reads (NVLink counters, retired pages, recovery action,
        clock-event durations): `schedules.health`; the next telemetry poll carries them."""
        self.backend.health_counters()

    def energy(self) -> None:
        """The energy counters, on their own schedule: ~3.9 ms a GPU on an H100, 100x
        the rest of a sample, so never part of the telemetry poll."""
        self.cache.put_energy(self.backend.energy())
