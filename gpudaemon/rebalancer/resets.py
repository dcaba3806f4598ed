"""The rebalancer's half of resetting a GPU in place (`remediation.reset_gpu`): after
the drain has taken a `reset_gpu` GPU's holders off it, grant its reset to the node's
agent (the Node annotation `<prefix>gpu-reset`, remediation/grant.py), within the
fleet's limits, which only this leader sees:

- at most `max_concurrent` grants live across the fleet, one per node (one annotation);
- none while the circuit breaker is open: more than `max_unhealthy_fraction` of the
  fleet's GPUs turned unhealthy within `window_s` (a fleet-wide event: a bad driver
  roll-out, a cooling failure, is not fixed by resetting GPUs one by one);
- none outside the maintenance window;
- the same GPU not again within RETRY_S of its last grant (the agent refused it, or
  its reset failed and it waits for the next fault or the escalation).

A grant ends when the agent removes it (the reset ran or was refused) or when it runs
out (`grant_ttl_s`; then this side removes it). Dry run: logged, never written."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from loguru import logger

from gpudaemon.config.remediation import RemediationConfig
from gpudaemon.errors import BadValueError, KubeError
from gpudaemon.kube.client import KubeClient
from gpudaemon.logsetup import LogLimiter
from gpudaemon.rebalancer.drain import SickGpu
from gpudaemon.rebalancer.planner import PodFacts
from gpudaemon.remediation import grant as grants
from gpudaemon.remediation.window import open_at

RETRY_S = 60.0
# Why no grant was written for a GPU ready for one (the counter's `result`).
RESULTS = ("granted", "planned", "concurrency", "breaker_open", "window_closed", "expired",
           "failed")  # fmt: skip


@dataclass(frozen=True)
class Live:
    """A grant as the Node watch last showed it: its raw text (for the removal's test)."""

    grant: grants.Grant
    raw: str


class GrantWatch:
    """The grants on the Nodes, by node, from the Node watch (nodes watch thread; the
    pass reads a copy)."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.live: dict[str, Live] = {}
        self._bad = LogLimiter()

    def node_event(self, kind: str, obj: Mapping[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        name = str(meta.get("name", ""))
        if kind == "DELETED":
            self.live.pop(name, None)
            return
        raw = (meta.get("annotations") or {}).get(self.key)
        if raw is None or raw == "":
            self.live.pop(name, None)
            return
        try:
            self.live[name] = Live(grants.parse(raw, self.key), str(raw))
        except BadValueError as e:
            # Not ours (the admission policy lets only us write it): it blocks the node
            # like a live grant until it runs out, and is removed then.
            if self._bad.allow(name):
                logger.warning("rebalancer: node {}: unreadable reset grant: {}", name, e)
            self.live[name] = Live(grants.Grant("", -1, 0.0, 0.0), str(raw))

    def replace(self, items: Iterable[Mapping[str, Any]]) -> None:
        self.live = {}
        for obj in items:
            self.node_event("ADDED", obj)


class ResetGrants:
    """Decides the grants of one pass and writes them (the leader only)."""

    def __init__(
        self,
        cfg: RemediationConfig,
        dry_run: bool,
        kube: KubeClient,
        watch: GrantWatch,
        count: Callable[[str], None],
        breaker: Callable[[bool], None],
        checkpoint: Callable[[], bool],
        wall: Callable[[], float],
    ) -> None:
        self.cfg, self.dry_run, self.kube, self.watch = cfg, dry_run, kube, watch
        self.count, self.breaker, self.checkpoint, self.wall = count, breaker, checkpoint, wall
        self.granted_at: dict[tuple[str, str], float] = {}  # (node, uuid) -> last grant
        self.waiting = False  # a GPU waits for its holders to go: poll soon
        self._told = LogLimiter(600.0)  # a refusal: counted and told every 10 min

    def run(
        self,
        sick: list[SickGpu],
        running: Mapping[str, PodFacts],
        fresh: Mapping[str, bool],
        gpus_total: int,
        unhealthy_since: Mapping[tuple[str, str], float],
    ) -> list[tuple[str, grants.Grant]]:
        """One pass: expire old grants, then grant what may go. The grants written."""
        now = self.wall()
        live = dict(self.watch.live)
        for node, held in list(live.items()):
            if held.grant.until <= now:
                self._remove(node, held, "expired")
                del live[node]
        self.granted_at = {k: t for k, t in self.granted_at.items() if now - t < RETRY_S}
        ready = [g for g in sick if self._ready(g, running, fresh)]
        # A reset_gpu GPU still drained, or a grant out: the loop looks again in a second
        # (a holder's deletion is a pod event, not a Node event that would wake it).
        self.waiting = bool(live) or any(
            g.action == "reset_gpu"
            and fresh.get(g.node)
            and (g.node, g.uuid) not in self.granted_at
            for g in sick
        )
        if not ready:
            return []
        recent = sum(1 for t in unhealthy_since.values() if now - t <= self.cfg.window_s)
        is_open = gpus_total > 0 and recent / gpus_total > self.cfg.max_unhealthy_fraction
        self.breaker(is_open)
        if is_open:
            self._refuse(ready, "breaker_open",
                         f"{recent} of {gpus_total} GPUs turned unhealthy within "
                         f"{self.cfg.window_s:.0f} s (over "
                         f"{self.cfg.max_unhealthy_fraction:.0%}): a fleet-wide event")  # fmt: skip
            return []
        if not open_at(self.cfg.maintenance_window, now):
            window = self.cfg.maintenance_window
            self._refuse(ready, "window_closed", f"outside the maintenance window {window} UTC")
            return []
        out = []
        for g in sorted(ready, key=lambda g: -g.for_s):  # the longest sick first
            if g.node in live:
                continue  # one reset per node at a time
            if len(live) >= self.cfg.max_concurrent:
                self._refuse([g], "concurrency",
                             f"{len(live)} GPU(s) in reset already (remediation.max_concurrent "
                             f"{self.cfg.max_concurrent})")  # fmt: skip
                continue
            grant = grants.Grant(g.uuid, g.index, now, now + self.cfg.grant_ttl_s)
            if self._write(g, grant):
                live[g.node] = Live(grant, grant.encode())
                out.append((g.node, grant))
        return out

    def _ready(
        self, g: SickGpu, running: Mapping[str, PodFacts], fresh: Mapping[str, bool]
    ) -> bool:
        """A reset_gpu GPU on a fresh node whose holders are all gone (a pod still
        terminating holds it), not granted within RETRY_S."""
        if g.action != "reset_gpu" or not g.uuid or not fresh.get(g.node):
            return False
        if (g.node, g.uuid) in self.granted_at:
            return False
        if g.for_s < self.cfg.drain_grace_s:
            return False
        return not any((p := running.get(k)) is not None and p.node == g.node for k in g.holders)

    def _refuse(self, gpus: list[SickGpu], result: str, why: str) -> None:
        for g in gpus:
            if self._told.allow((g.node, g.uuid, result)):
                self.count(result)
                logger.info("rebalancer: not resetting GPU {} on {} yet: {}", g.index, g.node, why)

    def _write(self, g: SickGpu, grant: grants.Grant) -> bool:
        self.granted_at[(g.node, g.uuid)] = grant.granted_at
        if self.dry_run:
            self.count("planned")
            logger.info("rebalancer (dry run): would grant the reset of GPU {} ({}) on {}",
                        g.index, g.uuid, g.node)  # fmt: skip
            return False
        if not self.checkpoint():
            return False  # lost the Lease: the new leader decides
        body = {"metadata": {"annotations": {self.watch.key: grant.encode()}}}
        try:
            self.kube.request("PATCH", f"/api/v1/nodes/{g.node}", body,
                              content_type="application/merge-patch+json")  # fmt: skip
        except KubeError as e:
            self.count("failed")
            logger.warning("rebalancer: granting the reset of GPU {} on {}: {}", g.index, g.node, e)
            return False
        self.count("granted")
        self._told.forget((g.node, g.uuid, "concurrency"))
        logger.info("rebalancer: granted the reset of GPU {} ({}) on {}: {} ({:.0f} s), its "
                    "pods gone", g.index, g.uuid, g.node, g.reason, g.for_s)  # fmt: skip
        return True

    def _remove(self, node: str, live: Live, result: str) -> None:
        if self.dry_run:
            return
        path = "/metadata/annotations/" + self.watch.key.replace("~", "~0").replace("/", "~1")
        ops = [{"op": "test", "path": path, "value": live.raw}, {"op": "remove", "path": path}]
        try:
            self.kube.request("PATCH", f"/api/v1/nodes/{node}", ops,
                              content_type="application/json-patch+json")  # fmt: skip
        except KubeError as e:
            if e.status not in (404, 409, 422):
                logger.warning("rebalancer: removing the reset grant on {}: {}", node, e)
            return
        self.count(result)
        logger.warning("rebalancer: the reset grant for GPU {} on {} ran out without an "
                       "answer from the agent; removed", live.grant.uuid or "?", node)  # fmt: skip
