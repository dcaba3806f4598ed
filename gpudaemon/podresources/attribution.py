"""Keeps the current device -> pod map, refreshed on its own schedule.

A scrape calls `get()`, which only returns the last map: the gRPC call happens in
`refresh()`, run by the scheduler, so a slow kubelet can never slow a scrape.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from types import MappingProxyType

from loguru import logger

from gpudaemon.model import PodMap
from gpudaemon.podresources.client import (
    DEFAULT_TIMEOUT_S,
    Assignment,
    DraResolver,
    device_map,
    list_pod_resources,
)

Lister = Callable[..., list[Assignment]]
_EMPTY: PodMap = MappingProxyType({})


class PodAttribution:
    def __init__(
        self,
        socket_path: str,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        lister: Lister = list_pod_resources,
        dra_device_uuid: DraResolver | None = None,
    ) -> None:
        """`dra_device_uuid(driver, pool, device)`: the UUID of a device a container
        holds through a ResourceClaim (None: not a GPU of ours); without it, DRA
        devices are not attributed."""
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self._lister = lister
        self._dra = dra_device_uuid
        self._map: PodMap = _EMPTY
        self._socket_seen: bool | None = None  # None: not looked yet

    def get(self) -> PodMap:
        return self._map  # replaced whole, never mutated: safe without a lock

    def _list(self) -> list[Assignment]:
        if self._dra is None:
            return self._lister(self.socket_path, self.timeout_s)
        return self._lister(self.socket_path, self.timeout_s, dra=self._dra)

    def refresh(self) -> None:
        """Fetch the map once. A missing socket means "no kubelet mounted": no
        attribution and one log line per change, not an error. A failing List
        raises PodResourcesError and keeps the last good map."""
        present = os.path.exists(self.socket_path)
        if present != self._socket_seen:
            if present:
                logger.info("pod attribution: reading {}", self.socket_path)
            else:
                logger.info(
                    "pod attribution off: {} not found (mount the kubelet pod-resources "
                    "directory to label GPU series with pod, namespace, container)",
                    self.socket_path,
                )
            self._socket_seen = present
        if not present:
            self._map = _EMPTY
            return
        self._map = MappingProxyType(dict(device_map(self._list())))
