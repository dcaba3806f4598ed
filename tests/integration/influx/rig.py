"""An in-process agent for the InfluxDB tests: simulated dgx-h100 GPUs, an injected
clock (so every sample time is known), the real InfluxWriter and a recording of what
InfluxDB accepted, in order."""

from __future__ import annotations

import io
from pathlib import Path

from prometheus_client import CollectorRegistry

from gpudaemon import catalogue
from gpudaemon.agent.app import Agent
from gpudaemon.backends.simulated import SimulatedBackend, load_profile
from gpudaemon.config import load_config
from gpudaemon.history.transport import Transport
from gpudaemon.history.writer import InfluxWriter
from gpudaemon.labels.outputs import StdoutSink
from tests.clock import T0 as T0
from tests.clock import FakeClock

PERIOD = 10.0
# Fields the simulated dgx-h100 always reports, plus those the writer always adds;
# retired pages exist on pre-Ampere GPUs only (an H100 remaps rows instead).
ALWAYS = {r.influx_field for r in catalogue.rows("gpu") if not r.label} - {
    "retired_pages_pending",
} | {"healthy", "xid_errors_total"}
# GPM's fields (issue 33) need two samples: a process's first poll has none of them.
GPM_FIELDS = {
    *(f"{m}_active_ratio" for m in ("sm", "tensor", "dram", "fp64")),
    "sm_occupancy_ratio",
    *(f"{bus}_{d}_bytes_total" for bus in ("nvlink", "pcie") for d in ("tx", "rx")),
}


Clock = FakeClock  # the shared test clock (tests/clock.py); starts at T0


class Recording:
    """Delegates to the real transport and remembers what InfluxDB accepted, in
    order, so a test can check the replay order (a query only shows time order)."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.accepted: list[int] = []

    def write(self, body: bytes) -> None:
        self.inner.write(body)
        self.accepted += [int(line.rsplit(b" ", 1)[1]) for line in body.splitlines()]

    def close(self) -> None:
        self.inner.close()


class Rig:
    """One in-process agent; `cycle()` is one telemetry poll, one energy read and one
    history run (as with `schedules.energy` equal to the history schedule)."""

    def __init__(self, tmp: Path, url: str, db: str, clock: Clock, **influx: object) -> None:
        self.clock = clock
        self.registry = CollectorRegistry()
        token = str(influx.pop("token", ""))
        self.cfg = load_config(
            environ={"GPUDAEMON_INFLUXDB__TOKEN": token} if token else {},
            overrides={
                "node_name": "node-it",
                "simulate": "dgx-h100",
                "influxdb": {
                    "url": url,
                    "bucket": f"{db}/autogen",
                    "spool_dir": str(tmp / "spool"),
                    "timeout_ms": 5000,  # generous: a loaded CI machine is slow
                    "shutdown_flush_seconds": 5,
                    **influx,
                },
            },
        )
        backend = SimulatedBackend(load_profile("dgx-h100"), seed=5, clock=clock)
        self.agent = Agent(
            self.cfg,
            backend=backend,
            registry=self.registry,
            label_sink=StdoutSink(io.StringIO()),
            clock=clock,
        )
        assert isinstance(self.agent.history, InfluxWriter)
        self.writer: InfluxWriter = self.agent.history
        self.recording = Recording(self.writer.transport)
        self.writer.transport = self.recording
        assert self.agent.poll_inventory()
        self.times: list[float] = []

    def cycle(self) -> None:
        self.clock.t += PERIOD
        assert self.agent.poll_telemetry()
        assert self.agent.run_job("energy")
        self.times.append(self.agent.cache.get().samples_at)
        assert self.agent.flush_history()  # a failing InfluxDB is not a failing job

    def metric(self, name: str, **labels: str) -> float:
        v = self.registry.get_sample_value(name, labels)
        assert v is not None, f"{name}{labels} not exported"
        return v

    def close(self) -> None:
        self.agent.close()
