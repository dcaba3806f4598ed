"""This node's GPUs as NVIDIA's DRA driver publishes them: the driver's ResourceSlices
for our node (`spec.nodeName`), read through the API server and kept as a small index
from a GPU's or MIG device's UUID to its DRA name (pool, device) and back.

Both DRA halves of the agent read it: the device taints (agent/devicetaints.py) find
the device a sick GPU is, and pod attribution (podresources/) finds the GPU a claim's
device is. The slices change only when the driver restarts or MIG is reconfigured, so
they are read once and again only on a miss (a UUID or device we do not know), at
most once per `reread_after_s`: a node without the driver costs one list per period,
not one per lookup.

Slices are another program's objects, read by the parser the extender uses too
(`kube/draslices.py`): each value is bounded and checked, a device without a usable
name, `type` or UUID is skipped (and counted), never trusted.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from loguru import logger

from gpudaemon.errors import KubeError
from gpudaemon.kube.draslices import DRIVER, BadDraObject, gather_pools, parse_slice

SLICES_PATH = "/apis/resource.k8s.io/v1/resourceslices"
# A ResourceSlice holds at most 128 devices (resource.k8s.io/v1 ResourceSliceMaxDevices);
# a node with more than this many GPU and MIG devices is not a node.
MAX_DEVICES = 4096


class SliceClient(Protocol):
    def list_items(
        self, path: str, query: Mapping[str, str] | None = None, page_size: int = 500
    ) -> tuple[list[dict[str, Any]], str]: ...


@dataclass(frozen=True)
class DraDevice:
    """One device of our node's slices: its DRA name and what the driver says it is."""

    pool: str
    name: str
    uuid: str
    kind: str = "gpu"  # gpu | mig
    parent_uuid: str = ""  # a MIG device's GPU


def parse_slices(slices: list[dict[str, Any]], node: str) -> tuple[list[DraDevice], int]:
    """Our driver's GPU and MIG devices on `node`, by the rule every program shares
    (`kube/draslices.py`: the newest generation of each pool, once complete; a device
    is a GPU or MIG device only by its `type`), and how many entries were skipped as
    unusable (a malformed slice or device, one with no `type` or no UUID)."""
    parsed = []
    skipped = 0
    for s in slices:
        spec = s.get("spec") if isinstance(s, Mapping) else None
        if not isinstance(spec, Mapping) or spec.get("driver") != DRIVER:
            continue
        if spec.get("nodeName") != node:
            continue
        try:
            one = parse_slice(s)
        except BadDraObject:
            skipped += 1
            continue
        if one is not None:
            parsed.append(one)
            skipped += one.skipped
    out: list[DraDevice] = []
    for pool, devices in gather_pools(parsed).items():
        for d in devices:
            if len(out) >= MAX_DEVICES or not d.kind or not d.uuid:
                skipped += 1
                continue
            out.append(DraDevice(pool, d.name, d.uuid, d.kind, d.parent_uuid))
    return out, skipped


class SliceIndex:
    """UUID <-> (pool, device) for our node, read lazily and again on a miss."""

    def __init__(
        self,
        client: SliceClient,
        node: str,
        *,
        reread_after_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        on_skipped: Callable[[int], None] | None = None,
    ) -> None:
        self.client = client
        self.node = node
        self.reread_after_s = reread_after_s
        self.clock = clock
        self.on_skipped = on_skipped
        self._lock = threading.Lock()
        self._by_uuid: dict[str, DraDevice] = {}
        self._by_name: dict[tuple[str, str], DraDevice] = {}
        self._read_at = -float("inf")
        self._loaded = False
        self._said_empty = False
        self._failed: KubeError | None = None  # the last read's error, until the next

    def read(self) -> None:
        """List our node's slices now. Raises KubeError."""
        items, _ = self.client.list_items(
            SLICES_PATH, {"fieldSelector": f"spec.nodeName={self.node}"}
        )
        devices, skipped = parse_slices(items, self.node)
        with self._lock:
            self._by_uuid = {d.uuid: d for d in devices}
            self._by_name = {(d.pool, d.name): d for d in devices}
            self._loaded = True
        if skipped and self.on_skipped is not None:
            self.on_skipped(skipped)
        if not devices and not self._said_empty:
            self._said_empty = True
            logger.warning(
                "DRA: no {} ResourceSlice for node {}: is NVIDIA's DRA driver installed "
                "here? No device taints are written until it publishes one",
                DRIVER,
                self.node,
            )
        elif devices and self._said_empty:
            self._said_empty = False
            logger.info("DRA: node {} has {} {} device(s)", self.node, len(devices), DRIVER)

    @property
    def pools(self) -> set[str]:
        """The pools of our node's devices, as last read."""
        return {d.pool for d in self._by_uuid.values()}

    @property
    def empty(self) -> bool:
        """Read, and our driver has no device on this node."""
        return self._loaded and not self._by_uuid

    def _ensure(self, found: Callable[[], DraDevice | None]) -> DraDevice | None:
        hit = found()
        if hit is not None:
            return hit
        now = self.clock()
        if now - self._read_at < self.reread_after_s:
            # A failed read is not tried again before the period either (one list per
            # period, not one per claim device), but still fails its callers.
            if self._failed is not None:
                raise self._failed
            return None
        self._read_at = now
        try:
            self.read()
        except KubeError as e:
            self._failed = e
            raise
        self._failed = None
        return found()

    def by_uuid(self, uuid: str) -> DraDevice | None:
        """The device that is this GPU (or MIG device); re-read on a miss. Raises
        KubeError when the slices cannot be read."""
        return self._ensure(lambda: self._by_uuid.get(uuid))

    def for_gpu(self, uuid: str) -> list[DraDevice]:
        """The GPU's device and its MIG devices (a sick GPU takes its MIG devices with
        it); re-read on a miss. Raises KubeError."""

        def found() -> list[DraDevice]:
            return [d for d in self._by_uuid.values() if uuid in (d.uuid, d.parent_uuid)]

        hit = self._ensure(lambda: next(iter(found()), None))
        return found() if hit is not None else []

    def by_name(self, pool: str, device: str) -> DraDevice | None:
        return self._ensure(lambda: self._by_name.get((pool, device)))

    def uuid_of(self, driver: str, pool: str, device: str) -> str | None:
        """For pod attribution: the UUID of a claim's device, None if it is not one of
        our driver's (or the slices cannot be read now: logged once by the caller)."""
        if driver != DRIVER:
            return None
        try:
            dev = self.by_name(pool, device)
        except KubeError as e:
            logger.debug("DRA: slices not read for attribution: {}", e)
            return None
        return dev.uuid if dev is not None else None
