"""The agent's half of resetting a GPU in place (`remediation.reset_gpu`): when the
rebalancer grants the reset (the Node annotation `<prefix>gpu-reset`, seen by the Node
watch within a second), check that nobody uses the GPU, run the host driver's tool,
watch the GPU read healthy for `settle_s`, and return it to service; or, when resets do
not fix it, escalate its action to `reboot_node`.

The rebalancer decides *when* (the GPU drained, the fleet's concurrency limit, the
circuit breaker, the maintenance window); this side decides *whether*, with what only
the node knows, at the last moment:

- the GPU's verdict still asks for `reset_gpu` (not healthy again, not lost);
- no pod holds it or one of its MIG devices (kubelet pod-resources, device plugin and
  DRA), and NVML shows no process on it;
- it can be reset alone (nvsmi.can_reset_alone);
- it has been reset fewer than `max_attempts` times in 24 h.

While a GPU is in reset or settling it stays quarantined whatever it reads (its verdict
says `reset in progress`), and the result is one Node Event (`GPUReset`, or
`GPUResetFailed` when it escalates) and one count in `gpudaemon_gpu_resets_total`."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from loguru import logger

from gpudaemon.agent.healthmemory import HealthMemory
from gpudaemon.agent.metrics.selfmetrics import AgentMetrics
from gpudaemon.agent.wakeloop import WakeLoop
from gpudaemon.backends import Backend
from gpudaemon.config.remediation import RemediationConfig
from gpudaemon.errors import BadValueError, GpudaemonError
from gpudaemon.health import verdict
from gpudaemon.logsetup import LogLimiter
from gpudaemon.model import GpuInfo, GpuSample, PodMap, Snapshot
from gpudaemon.remediation import grant as grants
from gpudaemon.remediation.nvsmi import can_reset_alone

DAY_S = 86400.0
SETTLE_POLL_S = 1.0  # polls while settling: a fault that comes back is seen at once
IN_RESET = "reset in progress"


class GpuResetter:
    """Runs on its own thread (`start`); `on_node` and `apply` are called from others."""

    def __init__(
        self,
        cfg: RemediationConfig,
        backend: Backend,
        memory: HealthMemory | None,
        metrics: AgentMetrics,
        *,
        grant_key: str,
        snapshot: Callable[[], Snapshot],
        pods: Callable[[], PodMap] | None,
        poll: Callable[[], object],
        reconcile: Callable[[], object],
        clear_grant: Callable[[str], None],
        event: Callable[[str, str, bool], object],
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.cfg, self.backend, self.memory, self.metrics = cfg, backend, memory, metrics
        self.grant_key = grant_key
        self.snapshot, self.pods = snapshot, pods
        self.poll, self.reconcile = poll, reconcile
        self.clear_grant, self.event = clear_grant, event
        self.clock, self.wall = clock, wall
        self._lock = threading.Lock()
        self._loop = WakeLoop("gpu-reset", self.step)
        self._stop = self._loop.stopping
        self._grant: grants.Grant | None = None
        self._grant_raw = ""
        self._done: set[str] = set()  # grant ids already acted on
        self._in_reset: dict[str, str] = {}  # uuid -> the reason the reset is for
        self._raw: dict[str, GpuSample] = {}  # uuid -> its last sample as NVML judged it
        self._escalated: set[str] = set()  # told by an Event
        self._gauged: set[str] = set()  # with an escalation series
        self._local_resets: dict[str, list[float]] = {}  # when there is no fault record
        self._bad_grant = LogLimiter()

    # -- inputs (other threads) -------------------------------------------------------

    def on_node(self, node: Mapping[str, Any]) -> None:
        """Every view of our Node: a new grant wakes the reset."""
        raw = ((node.get("metadata") or {}).get("annotations") or {}).get(self.grant_key)
        try:
            g = grants.of_node(node, self.grant_key)
        except BadValueError as e:
            if self._bad_grant.allow():
                logger.warning("ignoring the reset grant on our Node: {}", e)
            return
        if g is None:
            return
        with self._lock:
            if g.id in self._done or (self._grant is not None and self._grant.id == g.id):
                return
            self._grant, self._grant_raw = g, str(raw)
        self._loop.wake()

    def apply(self, samples: Sequence[GpuSample]) -> tuple[GpuSample, ...]:
        """Every telemetry poll (after the health memory): a GPU in reset stays
        quarantined; one whose resets are spent escalates to reboot_node."""
        out = []
        with self._lock:
            for s in samples:
                self._raw[s.uuid] = s
                if s.uuid in self._in_reset:
                    s = verdict.apply(
                        s, verdict.Verdict("unhealthy", "reset_gpu",
                                           f"{IN_RESET} ({self._in_reset[s.uuid]})"))  # fmt: skip
                elif s.health_action == "reset_gpu" and self._spent(s.uuid):
                    n = self._resets(s.uuid)
                    why = f"{s.health_reason}; {n} reset(s) in 24 h did not fix it"
                    s = verdict.apply(s, verdict.Verdict("unhealthy", "reboot_node", why))
                    self._gauge(s, 1)
                elif s.uuid in self._gauged:
                    self._gauge(s, 0)
                out.append(s)
        return tuple(out)

    def _gauge(self, s: GpuSample, value: int) -> None:
        """The escalation gauge follows the verdict (a restarted agent re-escalates
        from the reset times it read back)."""
        self.metrics.gpu_reset_escalated.labels(str(s.index), s.uuid).set(value)
        self._gauged.add(s.uuid)

    def _resets(self, uuid: str) -> int:
        if self.memory is not None:
            return self.memory.resets_within(uuid, DAY_S)
        since = self.wall() - DAY_S
        return sum(1 for t in self._local_resets.get(uuid, ()) if t >= since)

    def _spent(self, uuid: str) -> bool:
        return self._resets(uuid) >= self.cfg.max_attempts

    # -- the thread -------------------------------------------------------------------

    def start(self) -> None:
        self._loop.start()

    def stop(self) -> None:
        self._loop.stop(timeout_s=self.cfg.reset_timeout_s + 5)

    def step(self) -> str:
        """Act on the pending grant, if any; the result counted ("" when none)."""
        with self._lock:
            g, raw, self._grant = self._grant, self._grant_raw, None
            if g is None:
                return ""
            self._done.add(g.id)
        now = self.wall()
        if now > g.until or g.granted_at > now + 60.0:
            logger.info("reset grant for {} is out of date; ignored", g.uuid)
            return ""
        info, sample = self._gpu(g.uuid)
        if info is None or sample is None:
            return self._finish(g, raw, None, "blocked", f"GPU {g.uuid} is not on this node")
        why = self._refusal(info, sample)
        if why:
            return self._finish(g, raw, info, *why)
        return self._reset(g, raw, info, sample)

    def _gpu(self, uuid: str) -> tuple[GpuInfo | None, GpuSample | None]:
        snap = self.snapshot()
        infos = snap.inventory.gpus if snap.inventory is not None else ()
        info = next((i for i in infos if i.uuid == uuid), None)
        with self._lock:
            sample = self._raw.get(uuid)
        return info, sample

    def _refusal(self, info: GpuInfo, s: GpuSample) -> tuple[str, str] | None:
        """(result, why) when this GPU must not be reset now; None: go ahead."""
        if s.lost:
            return "blocked", "the GPU is lost: a reset cannot reach it (reboot_node)"
        if s.health_action != "reset_gpu":
            return "blocked", f"its verdict no longer asks for a reset ({s.health_state})"
        if self._spent(info.uuid):
            return "blocked", f"reset {self._resets(info.uuid)} times in 24 h already"
        if not can_reset_alone(info):
            return "blocked", (
                "an NVLink GPU before Ampere resets only with its NVLink peers; "
                "drain the node and reset them together"
            )
        holders = self._holders(info)
        if holders is None:
            return "skipped_busy", "cannot tell which pods hold it (pod-resources unavailable)"
        if holders:
            return "skipped_busy", f"held by {', '.join(sorted(holders)[:4])}"
        if s.process_count:
            return "skipped_busy", f"NVML shows {s.process_count} process(es) on it"
        return None

    def _holders(self, info: GpuInfo) -> set[str] | None:
        """The pods that hold the GPU or one of its MIG devices; None if unknown."""
        if self.pods is None:
            return None
        try:
            pods = self.pods()
        except Exception as e:  # the kubelet's socket: unknown means busy
            logger.debug("pod map unavailable for the reset check: {}", e)
            return None
        ids = {info.uuid, *(m.uuid for m in info.mig_devices)}
        return {f"{r.namespace}/{r.pod}" for k, r in pods.items() if k in ids}

    def _reset(self, g: grants.Grant, raw: str, info: GpuInfo, s: GpuSample) -> str:
        reason = s.health_reason
        with self._lock:
            self._in_reset[info.uuid] = reason
        started = self.clock()
        logger.warning("GPU {} ({}): resetting ({}), granted by the rebalancer",
                       info.index, info.uuid, reason)  # fmt: skip
        if self.memory is not None:
            self.memory.record_reset(info.uuid)
        else:  # no fault record kept (health.state_file ""): this process counts
            self._local_resets.setdefault(info.uuid, []).append(self.wall())
        result = self.backend.reset_gpu(info.index, self.cfg.nvidia_smi, self.cfg.reset_timeout_s)
        outcome, why = "success", ""
        if result.busy:
            outcome, why = "skipped_busy", result.message
        elif not result.ok:
            outcome, why = "failed", f"the reset tool failed: {result.message}"
        else:
            if self.memory is not None:
                self.memory.clear(info.uuid)  # the reset is the proof
            why = self._settle(info.uuid)
            if why:
                outcome = "failed"
        took = self.clock() - started
        with self._lock:
            del self._in_reset[info.uuid]
        return self._finish(g, raw, info, outcome, why, reason=reason, took=took)

    def _settle(self, uuid: str) -> str:
        """Poll until the GPU has read healthy for settle_s; why not ("" when it did)."""
        deadline = self.clock() + self.cfg.settle_s
        while True:
            self._safe(self.poll)
            with self._lock:
                s = self._raw.get(uuid)
            if s is None:
                return "the GPU is gone from the inventory after the reset"
            if s.health_state == "unhealthy":
                return f"still unhealthy after the reset: {s.health_reason}"
            if self.clock() >= deadline or self._stop.is_set():
                return ""
            self._stop.wait(min(SETTLE_POLL_S, max(0.0, deadline - self.clock())))

    def _finish(
        self,
        g: grants.Grant,
        raw: str,
        info: GpuInfo | None,
        outcome: str,
        why: str,
        *,
        reason: str = "",
        took: float | None = None,
    ) -> str:
        gpu = str(info.index) if info is not None else ""
        uuid = info.uuid if info is not None else g.uuid
        self.metrics.gpu_resets.labels(gpu, uuid, outcome).inc()
        name = f"GPU {gpu} ({uuid})" if info is not None else f"GPU {uuid}"
        if took is not None:
            self.metrics.gpu_reset_seconds.labels(outcome).observe(took)
        if outcome == "success":
            msg = f"{name} reset and back in service: {reason} cleared, healthy for " \
                  f"{self.cfg.settle_s:.0f} s after the reset; took {took or 0:.1f} s"  # fmt: skip
            logger.info("{}", msg)
        else:
            msg = f"{name} not reset ({outcome}): {why}"
            if took is not None:
                msg = f"{name} reset failed after {took:.1f} s ({reason}): {why}"
            logger.warning("{}", msg)
        # The verdict as it now stands (released, or escalated) goes out before the
        # grant is given back, so the rebalancer never re-grants on a stale verdict.
        self._safe(self.poll)
        self._safe(self.reconcile)
        if took is not None:  # a reset ran: the Node says how it went
            self.event("GPUReset", msg, outcome != "success")
            if outcome != "success" and info is not None and self._spent(uuid):
                self._escalate(info, reason)
        self._safe(lambda: self.clear_grant(raw))
        return outcome

    def _escalate(self, info: GpuInfo, reason: str) -> None:
        if info.uuid in self._escalated:
            return
        self._escalated.add(info.uuid)
        n = self._resets(info.uuid)
        msg = (f"GPU {info.index} ({info.uuid}): {n} reset(s) in 24 h did not fix {reason}; "
               "its action is now reboot_node (a machine health check or a person takes "
               "it from here)")  # fmt: skip
        logger.error("{}", msg)
        self.event("GPUResetFailed", msg, True)

    @staticmethod
    def _safe(fn: Callable[[], object]) -> None:
        try:
            fn()
        except GpudaemonError as e:
            logger.warning("during a GPU reset: {}", e)
