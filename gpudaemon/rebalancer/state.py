"""What the rebalancer keeps on its leader Lease, so that a restarted or new leader
carries on rather than starting afresh:

- in the state annotation, the rate-limit window and when each sick GPU was first
  seen (a new leader neither evicts past the limit nor starts the grace again);
- in the reservations annotation, the room kept for pending pods (the only place the
  extender reads it), written with every Lease write.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import replace

from loguru import logger

from gpudaemon.cluster.reservations import (
    MAX_RESERVE_S,
    RESERVATIONS_ANNOTATION,
    Reservation,
    encode,
)
from gpudaemon.labels.annotations import GpuState
from gpudaemon.rebalancer.drain import SickGpu, drain_action
from gpudaemon.rebalancer.ratelimit import RateLimit

STATE_ANNOTATION = "gpudaemon.io/rebalancer-state"
MAX_SAVED_SICK_GPUS = 2000  # keeps the annotation far below the 256 KiB object limit


class LeaseState:
    """The rate-limit window, the sick GPUs' grace clocks and the reservations, with
    their codec. `wall` is the wall clock the saved times are written in."""

    def __init__(self, limits: RateLimit, wall: Callable[[], float]) -> None:
        self.limits, self.wall = limits, wall
        self.unhealthy_since: dict[tuple[str, str], float] = {}  # (node, GPU uuid) -> wall
        # The room kept for pending pods, by pod UID: dropped when the pod binds or
        # goes, when it runs out, and when this replica stops leading.
        self.reservations: dict[str, Reservation] = {}

    def save(self) -> str:
        sick = sorted(self.unhealthy_since.items(), key=lambda kv: kv[1])
        return json.dumps(
            {
                "evictions": self.limits.export(self.wall()),
                "unhealthy_since": {
                    f"{n}/{u}": round(t, 3) for (n, u), t in sick[:MAX_SAVED_SICK_GPUS]
                },
            },
            separators=(",", ":"),
        )

    def load(self, text: str) -> None:
        """Merge another holder's state; an unreadable annotation is one warning."""
        if not text:
            return
        try:
            data = json.loads(text)
            if not isinstance(data, dict):
                raise ValueError("not an object")
        except ValueError as e:
            logger.warning("rebalancer: ignoring unreadable {} on the Lease: {}",
                           STATE_ANNOTATION, e)  # fmt: skip
            return
        evictions = data.get("evictions")
        self.limits.load(evictions if isinstance(evictions, list) else [], self.wall())
        since = data.get("unhealthy_since")
        for key, t in since.items() if isinstance(since, dict) else []:
            node, _, uuid = str(key).partition("/")
            if uuid and isinstance(t, int | float):
                k, t = (node, uuid), min(float(t), self.wall())  # not from the future
                self.unhealthy_since[k] = min(t, self.unhealthy_since.get(k, t))
        logger.info("rebalancer: carried on from the Lease: {} evictions in the last minute, "
                    "{} unhealthy GPUs' grace clocks", len(self.limits.export(self.wall())),
                    len(self.unhealthy_since))  # fmt: skip

    def sick_gpus(self, gpu_states: Mapping[str, Sequence[GpuState]]) -> list[SickGpu]:
        """Each GPU whose action needs its pods off it (drain, reset_gpu, reboot_node,
        replace; an older agent's unhealthy GPU: drain), timed from when it was first
        seen so (this leader or the one before: the clocks ride on the Lease). A GPU
        healthy or degraded again, or gone, starts its grace over."""
        now = self.wall()
        sick: list[SickGpu] = []
        seen: set[tuple[str, str]] = set()
        for node, gpus in gpu_states.items():
            for g in gpus:
                if not drain_action(g):  # healthy, degraded (watch): left alone
                    continue
                key = (node, g.uuid)
                seen.add(key)
                since = self.unhealthy_since.setdefault(key, now)
                sick.append(SickGpu.of(node, g, now - since))
        for key in set(self.unhealthy_since) - seen:
            del self.unhealthy_since[key]
        return sick

    def grace_left(self, grace_s: float) -> float | None:
        """Seconds until the first sick GPU whose grace still runs reaches its end (None:
        none does), so the leader can drain it then rather than at its next pass."""
        now = self.wall()
        left = [t + grace_s - now for t in self.unhealthy_since.values()]
        return min((x for x in left if x > 0), default=None)

    def live_reservations(self, pending: Container[str]) -> list[Reservation]:
        """Drop the reservations whose pod is bound or gone (not in `pending`), or whose
        time ran out; the rest, soonest to end first."""
        now = self.wall()
        self.reservations = {
            u: r for u, r in self.reservations.items() if r.until > now and u in pending
        }
        return sorted(self.reservations.values(), key=lambda r: r.until)

    def in_force(self, now: float) -> Mapping[str, Sequence[Reservation]]:
        """The rooms this replica keeps now, by node (cluster/reservations.py
        `KeptRooms`): what the `reserved` plug-in reads when the planner foresees where a
        moved pod lands, so no victim is planned into room kept for another pod. Its own
        memory, never the pods' annotations (anyone may write those)."""
        by_node: dict[str, list[Reservation]] = {}
        for r in list(self.reservations.values()):
            if r.until > now:
                by_node.setdefault(r.node, []).append(r)
        return by_node

    def annotations(self, pending: Container[str]) -> dict[str, str]:
        """Written with every Lease write: the reservations the extender honours."""
        return {RESERVATIONS_ANNOTATION: encode(self.live_reservations(pending))}

    def reserve(
        self, r: Reservation, pending: Container[str], reserve_s: float, max_reservations: int
    ) -> bool:
        """Keep the room made on `r.node` for the pending pod `r` (the evicted pods'
        replacements would otherwise take it back: spreading replicas scores the emptied
        node best) for `reserve_s` from now. Only in memory here: the caller's Lease
        checkpoint writes it before any eviction. False: `max_reservations` are live
        already, do not evict."""
        live = self.live_reservations(pending)
        if r.uid not in self.reservations and len(live) >= max_reservations:
            logger.info("rebalancer: not making room for {}: {} reservations live already",
                        r.pod, len(live))  # fmt: skip
            return False
        until = self.wall() + min(float(reserve_s), MAX_RESERVE_S)
        self.reservations[r.uid] = replace(r, until=until)
        return True
