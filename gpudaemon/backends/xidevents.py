"""XID events: the one loop that turns an NVML event set into counted XIDs and a wake-up
for whoever listens (the agent's quarantine path). Both backends run it: NVML's with
pynvml's event set, the simulator's with its own event set of the same API
(`SimEventSet`), so the tests exercise the very loop that runs on a GPU node.

A listener is told of every XID after it is counted; it must be quick (it runs on the
event thread) and must not raise. The XID storm case (thousands a second on one GPU)
costs one count and one listener call per event: coalescing is the listener's."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from typing import Any

from loguru import logger

XidListener = Callable[[int, int], None]  # (GPU index, XID)
WAIT_MS = 1000  # how long one wait blocks: the loop's answer time to a stop


def handle_key(h: Any) -> int:
    """A stable key for an NVML device handle (a ctypes pointer or a test object)."""
    contents = getattr(h, "contents", None)
    if contents is not None:
        try:
            import ctypes

            return ctypes.addressof(contents)
        except (TypeError, ValueError):
            pass
    return id(h)


def xid_event_loop(
    nvml: Any,
    handles: Sequence[Any],
    stop: threading.Event,
    record: XidListener,
    wait_ms: int = WAIT_MS,
) -> None:
    """Register every GPU for critical-XID events and call `record(index, xid)` for
    each event until `stop` is set. `nvml` is pynvml or a module of the same API."""
    n = nvml
    try:
        evset = n.nvmlEventSetCreate()
    except n.NVMLError as e:
        logger.warning("XID events unavailable: {}", e)
        return
    by_handle: dict[int, int] = {}
    for i, h in enumerate(handles):
        if h is None:
            continue
        try:
            n.nvmlDeviceRegisterEvents(h, n.nvmlEventTypeXidCriticalError, evset)
            by_handle[handle_key(h)] = i
        except n.NVMLError as e:
            logger.warning("GPU {}: XID events unavailable: {}", i, e)
    while not stop.is_set():
        try:
            data = n.nvmlEventSetWait(evset, wait_ms)
        except n.NVMLError as e:
            if getattr(e, "value", None) == n.NVML_ERROR_TIMEOUT:
                continue
            logger.warning("XID event wait failed: {}; retrying", e)
            stop.wait(1.0)
            continue
        record(by_handle.get(handle_key(data.device), -1), int(data.eventData))
    with contextlib.suppress(n.NVMLError):
        n.nvmlEventSetFree(evset)


class XidListeners:
    """The listeners of one backend's XID events (the agent subscribes one)."""

    def __init__(self) -> None:
        self._listeners: list[XidListener] = []

    def add(self, listener: XidListener) -> None:
        self._listeners.append(listener)

    def __bool__(self) -> bool:
        return bool(self._listeners)

    def tell(self, index: int, xid: int) -> None:
        for listener in list(self._listeners):
            try:
                listener(index, xid)
            except Exception as e:  # a listener's bug must not stop the event thread
                logger.opt(exception=e).error("XID listener failed: {}", e)
