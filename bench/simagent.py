"""A simulated agent for the fleet benchmarks, put together from the library modules the
agent itself runs (Poller, NodeLabeler, NodeLabelSink and its jobs, JobRunner), without
the application's wiring: no HTTP server, no scheduler thread, no history. A bench drives
its steps on a simulated or real clock, many agents in one process."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from prometheus_client import CollectorRegistry

from gpudaemon.agent.cache import Cache
from gpudaemon.agent.metrics.selfmetrics import AgentMetrics
from gpudaemon.agent.nodelabels import NodeLabelSink
from gpudaemon.agent.poller import Poller
from gpudaemon.backends.simulated import SimulatedBackend, load_profile
from gpudaemon.config import Config, load_config
from gpudaemon.kube.client import find_credentials
from gpudaemon.labels import NodeLabeler
from gpudaemon.schedule import Job, JobRunner


class SimAgent:
    def __init__(
        self,
        node: str,
        kubeconfig: Path,
        *,
        seed: int = 0,
        clock: Callable[[], float],
        profile: str = "dgx-h100",
        client: object | None = None,
        taint: bool = False,
    ) -> None:
        self.cfg: Config = load_config(
            environ={},
            overrides={
                "node_name": node,
                "labels": {"to": "apiserver", "taint_unhealthy": taint},
                "kubernetes": {"kubeconfig": str(kubeconfig)},
            },
        )
        k = self.cfg.kubernetes
        self.registry = CollectorRegistry()
        self.metrics = AgentMetrics(self.registry)
        self.backend = SimulatedBackend(load_profile(profile), seed=seed, clock=clock)
        self.cache = Cache(clock)
        self.poller = Poller(self.backend, self.cache)
        self.labeler = NodeLabeler(
            self.cfg.labels.prefix, mig_strategy=self.cfg.labels.mig_strategy
        )
        creds = None if client is not None else find_credentials(k.kubeconfig, False)
        self.sink = NodeLabelSink(
            k,
            node,
            creds,
            self.metrics,
            prefix=self.cfg.labels.prefix,
            taint_unhealthy=taint,
            clock=clock,
            client=client,  # type: ignore[arg-type]
        )
        self.sink.set_freshness(lambda: self.cache.age_seconds() is not None)
        jobs = [
            Job("inventory", self.cfg.schedules.inventory, self.poller.inventory),
            Job("telemetry", self.cfg.schedules.telemetry, self.poller.telemetry),
            Job("labels", self.cfg.schedules.labels, self.reconcile),
            *self.sink.jobs(),
        ]
        self.runner = JobRunner({j.name: j for j in jobs}, self.metrics)

    def reconcile(self) -> None:
        self.sink.apply(self.labeler.build(self.cache.get()))

    def run(self, job: str) -> bool:
        return self.runner.run(job)

    def run_once(self) -> bool:
        return all([self.run(j) for j in ("inventory", "telemetry", "labels", "lease")])

    def writes(self, result: str = "success") -> float:
        v = self.registry.get_sample_value("gpudaemon_node_writes_total", {"result": result})
        return v or 0.0

    def close(self) -> None:
        self.sink.close()
