"""GPU health where DRA sees it: one `DeviceTaintRule` (resource.k8s.io/v1, Kubernetes
1.37; KEP-5055) per device of an unhealthy GPU on this node, so kube-scheduler's
DynamicResources plugin allocates it to no new claim, removed when the GPU is healthy
again (a repair: a new boot ID clears the fault).

Each rule selects exactly one device: driver `gpu.nvidia.com`, the pool of our node's
ResourceSlice, and the device found there by the GPU's UUID (agent/resourceslices.py);
a GPU with MIG on takes its MIG devices with it. The effect is NoSchedule (or None:
only visible); NoExecute is refused here as by the chart's admission policy, because
evicting is the rebalancer's job, through the Eviction API and PDBs.

Rules are named from the node and the device (deterministic, so a restarted agent
finds its own) and carry our labels, so the agent lists exactly its own rules: at
start and every resync (garbage: rules for GPUs healthy now, or devices gone), and
writes only what differs. API errors back off (one line per outage, one when it ends)
and never reach the labels. Called within the label reconcile, and retried each
second while a write is owed and its backoff has run out.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
import re
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from loguru import logger

from gpudaemon.agent.resourceslices import DraDevice, SliceIndex
from gpudaemon.errors import KubeError, KubeNotFoundError
from gpudaemon.kube.backoff import Backoff
from gpudaemon.kube.draslices import DRIVER
from gpudaemon.labels.sanitize import sanitize_value
from gpudaemon.logsetup import LogLimiter
from gpudaemon.schedule import Job

RULES_PATH = "/apis/resource.k8s.io/v1/devicetaintrules"
TAINT_SUFFIX = "unhealthy"  # the taint key: <prefix>unhealthy
NODE_LABEL_SUFFIX = "node"  # our rules' label naming their node: <prefix>node
EFFECTS = ("None", "NoSchedule")  # never NoExecute: draining is the rebalancer's
NAME_LABEL = {"app.kubernetes.io/name": "gpudaemon", "app.kubernetes.io/component": "device-taint"}
_MAX_NAME = 253


class RuleClient(Protocol):
    def list_items(
        self, path: str, query: Mapping[str, str] | None = None, page_size: int = 500
    ) -> tuple[list[dict[str, Any]], str]: ...

    def apply(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]: ...

    def request(self, method: str, path: str) -> dict[str, Any]: ...

    def close(self) -> None: ...


def _digest(*parts: str) -> str:
    return hashlib.sha256("/".join(parts).encode()).hexdigest()[:8]


def rule_name(node: str, device: str) -> str:
    """`gpudaemon-<node>-<device>-<hash>`: readable, a DNS subdomain of at most 253
    characters, and unique per (node, device) even where truncation or a '-' in
    either would make two pairs read alike."""
    digest = _digest(node, device)
    room = _MAX_NAME - len("gpudaemon--") - len(digest) - 1
    head = f"{node}-{device}"[:room]
    # Each dot-separated part must begin and end with a letter or digit.
    head = re.sub(r"[-.]*\.[-.]*", ".", head).strip("-.")
    return f"gpudaemon-{head}-{digest}" if head else f"gpudaemon-{digest}"


def node_label_value(node: str) -> str:
    """The node as a label value (63 characters at most; a longer name is hashed)."""
    return sanitize_value(node)


def rule_body(prefix: str, node: str, dev: DraDevice, effect: str, value: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceTaintRule",
        "metadata": {
            "name": rule_name(node, dev.name),
            "labels": {**NAME_LABEL, prefix + NODE_LABEL_SUFFIX: node_label_value(node)},
        },
        "spec": {
            "deviceSelector": {"driver": DRIVER, "pool": dev.pool, "device": dev.name},
            "taint": {"key": prefix + TAINT_SUFFIX, "value": value, "effect": effect},
        },
    }


def _essence(rule: Mapping[str, Any]) -> tuple[Any, ...]:
    """What makes a rule ours as we want it: the selector and the taint, not the time
    the server stamped on it."""

    def part(obj: Any, key: str) -> Mapping[str, Any]:
        v = obj.get(key) if isinstance(obj, Mapping) else None
        return v if isinstance(v, Mapping) else {}

    spec = part(rule, "spec")
    sel, taint = part(spec, "deviceSelector"), part(spec, "taint")
    return (
        sel.get("driver"),
        sel.get("pool"),
        sel.get("device"),
        taint.get("key"),
        taint.get("value"),
        taint.get("effect"),
    )


class DeviceTaints:
    """Keeps this node's DeviceTaintRules equal to its unhealthy GPUs."""

    def __init__(
        self,
        client: RuleClient,
        node: str,
        slices: SliceIndex,
        *,
        prefix: str,
        effect: str = "NoSchedule",
        backoff_max_s: float = 60.0,
        resync_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
        rng: Callable[[], float] = random.random,
        on_write: Callable[[str], None] | None = None,
    ) -> None:
        if effect not in EFFECTS:
            raise ValueError(f"device taint effect {effect!r}: one of {', '.join(EFFECTS)}")
        self.client = client
        self.node = node
        self.slices = slices
        self.prefix = prefix
        self.effect = effect
        self.resync_s = resync_s
        self.clock = clock
        self.on_write = on_write or (lambda result: None)
        self.selector = ",".join(
            f"{k}={v}"
            for k, v in {**NAME_LABEL, prefix + NODE_LABEL_SUFFIX: node_label_value(node)}.items()
        )
        self.backoff = Backoff(1.0, backoff_max_s, rng)
        self._lock = threading.Lock()
        self._unhealthy: dict[str, str] | None = None  # GPU UUID -> why (taint value)
        self._have: dict[str, dict[str, Any]] | None = None  # our rules: None = list first
        self._done: dict[str, str] | None = None  # the unhealthy set last made true
        self._listed_at = -float("inf")
        self._retry_at = -float("inf")
        self._log = LogLimiter()
        self._missing = LogLimiter()  # once per GPU not found in the slices
        self._foreign = LogLimiter()  # once per rule of our name that is not ours

    # -- the agent's calls ----------------------------------------------------------

    def sync(self, unhealthy: Mapping[str, str]) -> bool:
        """Make the rules match `unhealthy` (GPU UUID -> reason); True if anything was
        written. Never raises: a failure backs off and `retry` tries again."""
        with self._lock:
            self._unhealthy = dict(unhealthy)
            return self._reconcile()

    def retry(self) -> bool:
        """Each second: only when a reconcile is owed and its backoff has run out."""
        with self._lock:
            if self._unhealthy is None or self.clock() < self._retry_at:
                return False
            owed = self._done != self._unhealthy
            if not owed and self.clock() - self._listed_at < self.resync_s:
                return False
            return self._reconcile()

    def jobs(self) -> list[Job]:
        return [Job("dra-retry", "* * * * * *", self.retry)]

    # -- reconcile ------------------------------------------------------------------

    def _reconcile(self) -> bool:
        now = self.clock()
        assert self._unhealthy is not None
        if now < self._retry_at:
            return False
        if self._done == self._unhealthy and now - self._listed_at < self.resync_s:
            return False
        wrote = False
        try:
            want, complete = self._desired(self._unhealthy)
            if self._have is None or now - self._listed_at >= self.resync_s:
                self._have = self._our_rules()
                self._listed_at = now
            for name in sorted(set(self._have) - set(want)):
                with contextlib.suppress(KubeNotFoundError):  # gone already: as wanted
                    self.client.request("DELETE", f"{RULES_PATH}/{name}")
                del self._have[name]
                self.on_write("deleted")
                wrote = True
                logger.info("node {}: DeviceTaintRule {} removed (GPU healthy)", self.node, name)
            for name, body in sorted(want.items()):
                if name in self._have and _essence(self._have[name]) == _essence(body):
                    continue
                if name not in self._have and self._someone_elses(name):
                    continue
                self._have[name] = self.client.apply(f"{RULES_PATH}/{name}", body)
                self.on_write("written")
                wrote = True
                sel = body["spec"]["deviceSelector"]
                logger.warning(
                    "node {}: DeviceTaintRule {} taints device {}/{} {} ({})",
                    self.node,
                    name,
                    sel["pool"],
                    sel["device"],
                    self.effect,
                    body["spec"]["taint"]["value"],
                )
        except KubeError as e:
            self._have = None  # list again before the next write
            delay = self.backoff.next_delay()
            self._retry_at = now + delay
            self.on_write("error")
            if self._log.allow():
                logger.warning(
                    "node {}: DeviceTaintRules not written: {}; retrying with backoff "
                    "(up to {:.0f}s), one more line when they are",
                    self.node,
                    e,
                    self.backoff.cap,
                )
            return wrote
        failures = self.backoff.failures
        self.backoff.reset()
        self._retry_at = -float("inf")
        # A GPU not (yet) in the slices keeps the reconcile owed: retried each second,
        # the slices re-read at most once per their re-read period.
        self._done = dict(self._unhealthy) if complete else None
        if self._log.forget():
            logger.info(
                "node {}: DeviceTaintRules written after {} failed attempt(s)", self.node, failures
            )
        return wrote

    def _someone_elses(self, name: str) -> bool:
        """A rule of this name exists without our labels (an admin's, another tool's):
        never overwritten (a forced apply would take it over, and our garbage pass
        would then delete it), said once and counted. One GET per rule we lack."""
        try:
            rule = self.client.request("GET", f"{RULES_PATH}/{name}")
        except KubeNotFoundError:
            return False
        meta = rule.get("metadata") if isinstance(rule, Mapping) else None
        labels = meta.get("labels") if isinstance(meta, Mapping) else None
        ours = dict(kv.split("=", 1) for kv in self.selector.split(","))
        if isinstance(labels, Mapping) and all(labels.get(k) == v for k, v in ours.items()):
            return False
        self.on_write("foreign")
        if self._foreign.allow(name):
            logger.warning(
                "node {}: DeviceTaintRule {} exists but is not ours (no gpudaemon labels): "
                "left as it is; rename or delete it to let the agent taint this device",
                self.node,
                name,
            )
        return True

    def _our_rules(self) -> dict[str, dict[str, Any]]:
        """This node's rules as the API server has them (by our labels)."""
        try:
            items, _ = self.client.list_items(RULES_PATH, {"labelSelector": self.selector})
        except KubeNotFoundError as e:
            # Before Kubernetes 1.37 there is no resource.k8s.io/v1 DeviceTaintRule.
            raise KubeNotFoundError(
                f"resource.k8s.io/v1 DeviceTaintRule is not served here (Kubernetes 1.37 "
                f"or newer is needed: docs/dra.md): {e}",
                e.status,
            ) from None
        # Only rules for our node's pools: another node's agent could label a rule of
        # its own pool with our node, and its deletion, refused to us, would stall us.
        pools = {self.node, *self.slices.pools}
        out: dict[str, dict[str, Any]] = {}
        for r in items:
            meta, spec = r.get("metadata"), r.get("spec")
            if not isinstance(meta, dict) or not isinstance(spec, dict):
                continue
            sel = spec.get("deviceSelector")
            name = meta.get("name")
            if (
                isinstance(name, str)
                and name
                and isinstance(sel, dict)
                and sel.get("pool") in pools
            ):
                out[name] = r
        return out

    def _desired(self, unhealthy: Mapping[str, str]) -> tuple[dict[str, dict[str, Any]], bool]:
        """Rule name -> rule, for every device of every unhealthy GPU, and whether each
        GPU was found. Raises KubeError when the slices cannot be read."""
        want: dict[str, dict[str, Any]] = {}
        complete = True
        for uuid, why in sorted(unhealthy.items()):
            devices = self.slices.for_gpu(uuid)
            if not devices:
                complete = False
                # No slice at all (no driver) was said once by the index.
                if not self.slices.empty and self._missing.allow(uuid):
                    logger.warning(
                        "node {}: unhealthy GPU {} is not in {}'s ResourceSlice for this "
                        "node: no DeviceTaintRule for it",
                        self.node,
                        uuid,
                        DRIVER,
                    )
                continue
            for dev in devices:
                body = rule_body(self.prefix, self.node, dev, self.effect, sanitize_value(why))
                want[body["metadata"]["name"]] = body
        return want, complete
