"""Wiring in one place: backend -> cache -> (labels, metrics, history), the scheduler
that drives the jobs, and the shutdown order."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol

from loguru import logger
from prometheus_client import CollectorRegistry

from gpudaemon.agent.cache import Cache
from gpudaemon.agent.devicetaints import DeviceTaints
from gpudaemon.agent.healthmemory import (
    DEFAULT_STATE_FILE,
    AnnotationStore,
    FileStore,
    HealthMemory,
)
from gpudaemon.agent.metrics.collector import GpuCollector, ReadingAgeCollector
from gpudaemon.agent.metrics.http import HttpServer, make_app
from gpudaemon.agent.metrics.selfmetrics import AgentMetrics
from gpudaemon.agent.poller import Poller
from gpudaemon.agent.quarantine import Quarantine
from gpudaemon.agent.reset import GpuResetter
from gpudaemon.agent.resourceslices import SliceIndex
from gpudaemon.backends import Backend, make_backend
from gpudaemon.config import AgentSettings
from gpudaemon.errors import ConfigError, GpudaemonError, NvmlUnavailableError
from gpudaemon.labels import LabelSet, NodeLabeler
from gpudaemon.labels.outputs import FileSink, NfdSink, NullSink, StdoutSink
from gpudaemon.model import PodMap
from gpudaemon.podresources import PodAttribution
from gpudaemon.schedule import CronScheduler, Job, JobRunner


class LabelSink(Protocol):
    """Where labels go. Every sink declares the same capabilities; the local outputs
    (labels/outputs.py) answer "none" to the optional ones."""

    name: str

    def apply(self, ls: LabelSet) -> bool: ...

    def jobs(self) -> Sequence[Job]:
        """Scheduled jobs of its own (the API server writer: kube-retry, lease)."""
        ...

    def set_freshness(self, fresh: Callable[[], bool]) -> None:
        """Told how to ask whether the agent's data is fresh (the Lease vouches only
        for fresh data)."""
        ...

    def start(self) -> None:
        """Background work of its own, for a long run (the API server writer: the
        watch of its own Node); not for `--once`."""
        ...

    def close(self) -> None: ...


class HistorySink(Protocol):
    def write(self, snap: Any) -> None: ...

    def close(self) -> None: ...


def make_label_sink(cfg: AgentSettings, metrics: AgentMetrics) -> LabelSink:
    to = cfg.labels.to
    if to == "stdout":
        return StdoutSink()
    if to == "nfd":
        return NfdSink(cfg.labels.nfd_path)
    if to == "none":
        return NullSink()
    if to == "apiserver":
        from gpudaemon.agent.nodelabels import NodeLabelSink
        from gpudaemon.kube.client import find_credentials

        k = cfg.kubernetes
        creds = find_credentials(k.kubeconfig, bool(k.in_cluster))
        if creds is None:
            from gpudaemon.config.environment import where_credentials_were_sought

            why = f"no Kubernetes credentials ({where_credentials_were_sought()})"
            if "to" in cfg.labels.model_fields_set:
                # Asked for (file, GPUDAEMON_LABELS__TO, --labels-to): never a fallback.
                raise ConfigError(
                    f"labels.to is apiserver, but there are {why}; give --kubeconfig, "
                    "or choose --labels-to stdout, nfd or a file"
                )
            # The default on a laptop: show the labels, and say why they go here.
            logger.warning(
                "labels.to is not set and there are {}: writing labels to stdout, not to "
                "the API server (set labels.to, --labels-to, to choose)",
                why,
            )
            return StdoutSink()
        return NodeLabelSink(
            k,
            cfg.node_name,
            creds,
            metrics,
            prefix=cfg.labels.prefix,
            taint_unhealthy=cfg.labels.taint_unhealthy,
        )
    return FileSink(to)


def make_history_sink(cfg: AgentSettings, registry: CollectorRegistry) -> HistorySink | None:
    if not cfg.influxdb.url:
        return None
    from gpudaemon.history.writer import InfluxWriter

    return InfluxWriter(cfg, registry)


def make_dra(
    cfg: AgentSettings, metrics: AgentMetrics
) -> tuple[SliceIndex | None, DeviceTaints | None]:
    """With `dra.enabled`: this node's ResourceSlices (for attribution and taints) and
    the DeviceTaintRule writer; (None, None) otherwise or without credentials."""
    if not cfg.dra.enabled:
        return None, None
    from gpudaemon.kube.client import KubeClient, find_credentials

    k = cfg.kubernetes
    creds = find_credentials(k.kubeconfig, bool(k.in_cluster))
    if creds is None:
        logger.warning("dra.enabled, but no Kubernetes credentials: no DeviceTaintRules")
        return None, None
    client = KubeClient.from_credentials(
        creds, k.request_timeout_seconds, k.connect_timeout_seconds
    )
    slices = SliceIndex(client, cfg.node_name, on_skipped=metrics.dra_devices_skipped.inc)
    taints = DeviceTaints(
        client,
        cfg.node_name,
        slices,
        prefix=cfg.labels.prefix,
        effect=cfg.dra.taint_effect,
        backoff_max_s=k.backoff_max_seconds,
        resync_s=k.resync_seconds,
        on_write=lambda result: metrics.device_taint_writes.labels(result).inc(),
    )
    return slices, taints


FAULTS_ANNOTATION = "gpu-faults"


def make_health_memory(
    cfg: AgentSettings, backend: Backend, sink: LabelSink
) -> tuple[HealthMemory | None, AnnotationStore | None]:
    """Where sticky GPU faults are remembered. "auto": on the Node (an annotation) when
    the agent writes to the API server; else a file on the node with real NVML, and
    nowhere with simulated GPUs (a laptop demo leaves no files behind)."""
    path = cfg.health.state_file
    if path == "auto":
        if sink.name == "apiserver":
            store = AnnotationStore(cfg.labels.prefix + FAULTS_ANNOTATION)
            return HealthMemory(store, backend.boot_id()), store
        path = "" if backend.name == "simulated" else DEFAULT_STATE_FILE
    if not path:
        return None, None
    return HealthMemory(FileStore(path), backend.boot_id()), None


GRANT_COMPONENT = "gpudaemon-agent"


def make_resetter(agent: Agent) -> GpuResetter | None:
    """With `remediation.reset_gpu` and the Node as the label destination (the grant
    arrives there): the GPU reset; None otherwise."""
    cfg = agent.cfg
    if not cfg.remediation.reset_gpu:
        return None
    sink = agent.label_sink
    from gpudaemon.agent.nodelabels import NodeLabelSink

    if not isinstance(sink, NodeLabelSink):
        logger.warning(
            "remediation.reset_gpu is on, but labels go to {}: resets are granted on the "
            "Node, so none will run",
            sink.name,
        )
        return None
    from gpudaemon.agent.reset import GpuResetter
    from gpudaemon.kube.events import NodeEvents
    from gpudaemon.remediation.grant import GRANT_ANNOTATION

    key = cfg.labels.prefix + GRANT_ANNOTATION
    events = NodeEvents(sink.client, cfg.node_name, GRANT_COMPONENT, uid=lambda: sink._node_uid)
    resetter = GpuResetter(
        cfg.remediation,
        agent.backend,
        agent.health_memory,
        agent.metrics,
        grant_key=key,
        snapshot=agent.cache.get,
        pods=agent.pods,
        poll=lambda: agent.run_job("telemetry"),
        reconcile=lambda: agent.run_job("labels"),
        clear_grant=lambda raw: sink.remove_annotation(key, raw),
        event=lambda reason, msg, warning: events.post(reason, msg, warning),
    )
    sink.node_observers.append(resetter.on_node)
    return resetter


class Agent:
    def __init__(
        self,
        cfg: AgentSettings,
        backend: Backend | None = None,
        registry: CollectorRegistry | None = None,
        label_sink: LabelSink | None = None,
        history_sink: HistorySink | None = None,
        pods: Callable[[], PodMap] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.cfg = cfg
        self.clock = clock
        # `registry`: every series /metrics serves. `own_registry` (inside it): all but
        # the per-GPU families, which the GPU collector renders once per snapshot.
        self.registry = registry or CollectorRegistry()
        self.own_registry = CollectorRegistry()
        self.registry.register(self.own_registry)
        self.metrics = AgentMetrics(self.own_registry)
        self.backend = backend or make_backend(cfg.simulate, seed=cfg.simulate_seed)
        self.metrics.set_build(self.backend.name)
        self.cache = Cache(clock)
        self.labeler = NodeLabeler(cfg.labels.prefix, mig_strategy=cfg.labels.mig_strategy)
        try:
            self.label_sink = label_sink or make_label_sink(cfg, self.metrics)
        except BaseException:  # a destination that cannot be had (exit 2): NVML let go
            self.backend.close()
            raise
        self.label_sink.set_freshness(lambda: self.readiness()[0])
        self.health_memory, self.faults_store = make_health_memory(
            cfg, self.backend, self.label_sink
        )
        self.poller = Poller(self.backend, self.cache, self.health_memory)
        self.history = (
            history_sink if history_sink is not None else make_history_sink(cfg, self.own_registry)
        )
        # DRA: this node's ResourceSlices and the DeviceTaintRules for its sick GPUs.
        self.slices, self.device_taints = make_dra(cfg, self.metrics)
        # Pod labels come from the kubelet socket unless the caller brings its own map.
        self.pod_attribution: PodAttribution | None = None
        if pods is None and cfg.metrics.pod_resources_socket:
            self.pod_attribution = PodAttribution(
                cfg.metrics.pod_resources_socket,
                dra_device_uuid=self.slices.uuid_of if self.slices is not None else None,
            )
            pods = self.pod_attribution.get
        self.pods = pods  # device id -> the container holding it, for metrics and the annotation
        self.own_registry.register(ReadingAgeCollector(self.cache, clock))
        self.gpu_collector = GpuCollector(self.cache, cfg.node_name, pods=pods)
        self.registry.register(self.gpu_collector)
        self.scheduler = CronScheduler(
            on_overrun=lambda job: self.metrics.job_overruns.labels(job).inc()
        )
        # The fast health path: a GPU turning unhealthy is written at once (quarantine.py).
        self.quarantine = Quarantine(
            poll=lambda: self.run_job("telemetry"),
            reconcile=lambda: self.run_job("labels"),
            unhealthy=self._unhealthy_uuids,
            observe=lambda trigger, s: self.metrics.quarantine_seconds.labels(trigger).observe(s),
        )
        self.jobs = self._job_table()
        self.runner = JobRunner(self.jobs, self.metrics)
        # Resetting a sick GPU in place, when the rebalancer grants it (agent/reset.py).
        self.resetter = make_resetter(self)
        if self.resetter is not None:
            self.poller.remediation = self.resetter.apply
        self.http: HttpServer | None = None
        self.stop_event = threading.Event()

    # -- jobs --------------------------------------------------------------------

    def _job_table(self) -> dict[str, Job]:
        """Every scheduled job, in data order: name, cron, function."""
        s = self.cfg.schedules
        table = [
            Job("inventory", s.inventory, self.poller.inventory),
            Job("telemetry", s.telemetry, self._telemetry),
            Job("labels", s.labels, self._labels),
        ]
        if s.energy != "none":
            table.append(Job("energy", s.energy, self.poller.energy))
        if s.health != "none":
            table.append(Job("health", s.health, self.poller.health_counters))
        if self.pod_attribution is not None:
            table.append(Job("pods", s.pods, self.pod_attribution.refresh))
        if self.history is not None:
            table.append(Job("history", s.history, self._history))
        table += self.label_sink.jobs()
        if self.device_taints is not None:
            table += self.device_taints.jobs()
        return {j.name: j for j in table}

    def run_job(self, name: str) -> bool:
        """Run one job through the one wrapper (timed, counted, logged); True when it
        succeeded or is not configured."""
        return self.runner.run(name)

    def _telemetry(self) -> None:
        self.poller.telemetry()
        self.quarantine.after_poll()

    def _unhealthy_uuids(self) -> frozenset[str]:
        return frozenset(s.uuid for s in self.cache.get().samples if not s.healthy)

    def _labels(self) -> None:
        snap = self.cache.get()
        if snap.inventory is not None:
            self.quarantine.published(frozenset(s.uuid for s in snap.samples if not s.healthy))
            ls = self.labeler.build(snap, self._pod_map())
            if self.faults_store is not None and self.faults_store.value:
                key = self.faults_store.key
                ls = replace(ls, annotations={**ls.annotations, key: self.faults_store.value})
            try:
                self.label_sink.apply(ls)
            finally:
                # Within the same reconcile, whether or not the labels went out (it
                # never raises: its failures back off on their own).
                if self.device_taints is not None:
                    self.device_taints.sync(
                        {
                            s.uuid: s.health_reason or s.health_state
                            for s in snap.samples
                            if s.health_state == "unhealthy"
                        }
                    )

    def _pod_map(self) -> PodMap | None:
        if self.pods is None:
            return None
        try:
            return self.pods()
        except Exception as e:  # attribution is best-effort: the labels still go out
            logger.debug("pod map unavailable for the annotation: {}", e)
            return None

    def _history(self) -> None:
        if self.history is not None:
            self.history.write(self.cache.get())

    def poll_inventory(self) -> bool:
        return self.run_job("inventory")

    def poll_telemetry(self) -> bool:
        return self.run_job("telemetry")

    def reconcile_labels(self) -> bool:
        return self.run_job("labels")

    def flush_history(self) -> bool:
        return self.run_job("history")

    def refresh_pods(self) -> bool:
        return self.run_job("pods")

    def run_once(self) -> bool:
        """One full cycle, in data order. True when every step succeeded. The Lease
        too: a cycle's labels are only worth something to a scheduler while a Lease
        vouches for them (it expires on its own afterwards)."""
        order = ("inventory", "health", "telemetry", "energy", "labels", "history", "lease")
        return all([self.run_job(name) for name in order])

    # -- readiness ---------------------------------------------------------------

    def readiness(self) -> tuple[bool, str]:
        age = self.cache.age_seconds()
        if age is None:
            return False, "not ready: no telemetry poll has finished yet"
        bound = self.cfg.metrics.stale_after_seconds
        if age > bound:
            return False, f"not ready: newest reading is {age:.0f}s old (bound {bound:.0f}s)"
        return True, f"ready: newest reading is {age:.1f}s old"

    # -- lifecycle ---------------------------------------------------------------

    def start_http(self) -> int:
        self.http = HttpServer(
            self.cfg.metrics.listen,
            make_app(self.registry, self.readiness, self.gpu_collector, self.own_registry),
        )
        self.http.start()
        logger.info("serving /metrics, /healthz, /readyz on {}", self.cfg.metrics.listen)
        return self.http.port

    def run(self, once: bool = False) -> int:
        """Run until stop_event is set (SIGTERM/SIGINT), or one cycle with once=True."""
        self.check_backend()
        if not once:
            try:
                self.start_http()
            except GpudaemonError:
                self.close()
                raise
        logger.info(
            "gpudaemon starting: node={} backend={} labels->{}",
            self.cfg.node_name,
            self.backend.name,
            self.label_sink.name,
        )
        if once:
            try:
                return 0 if self.run_once() else 1
            finally:
                self.close()
        self.read_back_faults()
        # First readings straight away (check_backend already took the inventory), so
        # /readyz and the labels don't wait a period.
        self.run_job("health")
        self.poll_telemetry()
        self.run_job("energy")
        self.reconcile_labels()
        self.refresh_pods()
        self.label_sink.start()
        self.quarantine.start()
        self.backend.subscribe(self.quarantine.on_xid)
        if self.resetter is not None:
            self.resetter.start()
        for job in self.jobs.values():
            self.scheduler.add(job.name, functools.partial(self.run_job, job.name), job.cron)
        self.scheduler.start()
        self.stop_event.wait()
        logger.info("stopping: finishing the current cycle")
        self.close()
        return 0

    def read_back_faults(self) -> None:
        """Before the first poll: the sticky faults recorded on our Node by the agent
        that ran before us, so its first labels already say the GPU is unhealthy. If
        the API server cannot be read now, the first label reconcile's read of the Node
        seeds them instead (they are merged, never dropped)."""
        if self.faults_store is None or self.health_memory is None:
            return
        read = getattr(self.label_sink, "read_node", None)
        if read is None:
            return
        try:
            node = read()
        except GpudaemonError as e:
            logger.warning("GPU fault record not read back yet ({}): retried with the labels", e)

            def seed_once(node: Mapping[str, Any]) -> None:
                self._seed_faults(node)
                self.label_sink.on_read = None  # type: ignore[attr-defined]

            self.label_sink.on_read = seed_once  # type: ignore[attr-defined]
            return
        self._seed_faults(node)

    def _seed_faults(self, node: Mapping[str, Any]) -> None:
        assert self.faults_store is not None and self.health_memory is not None
        before = dict(self.health_memory.faults)
        self.faults_store.seed(node)
        self.health_memory.load()
        if self.health_memory.faults != before:
            self.health_memory.persist()

    def check_backend(self) -> None:
        """Fail fast (exit 2) when NVML is missing; other errors are retried by the jobs."""
        try:
            self.cache.put_inventory(self.backend.inventory())
        except NvmlUnavailableError:
            self.close()
            raise
        except GpudaemonError as e:
            logger.error("first inventory failed, will retry on schedule: {}", e)

    def close(self) -> None:
        """Shutdown order: stop polling, let running jobs finish, flush history, close
        sinks and NVML, then stop serving."""
        self.quarantine.stop()
        if self.resetter is not None:
            self.resetter.stop()  # a reset under way finishes first (its timeout bounds it)
        self.scheduler.shutdown(wait=True)
        if self.history is not None:
            self.flush_history()
            try:
                self.history.close()
            except Exception as e:
                logger.error("closing history: {}", e)
        closers = [self.label_sink.close, self.backend.close]
        if self.device_taints is not None:
            closers.append(self.device_taints.client.close)
        for closer in closers:
            try:
                closer()
            except Exception as e:
                logger.error("shutdown: {}", e)
        if self.http is not None:
            self.http.stop()
            self.http = None
