"""The simulator's NVML event set: pynvml's event-set API (create, register, wait,
free) over the simulated XID faults, so the backend runs the same XID event loop as
NVML (backends/xidevents.py) and an XID reaches the agent's quarantine path the way a
real one does: when it happens, not at the next poll.

Timed XID faults (`after_s`) are released by the waiting thread itself when their time
comes; faults timed by polls (`after_polls`) are posted by the sample that fires them.
A fault with `count: N` is N events, delivered one at a time as the driver would."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


class SimNvmlError(Exception):
    """pynvml's NVMLError shape: the NVML return code in `value`."""

    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


@dataclass(frozen=True)
class SimHandle:
    """One simulated GPU's device handle (stable: the loop keys events by it)."""

    index: int


@dataclass(frozen=True)
class SimEventData:
    device: SimHandle
    eventType: int
    eventData: int


class SimEventSet:
    """The subset of pynvml the XID event loop calls, for the simulated GPUs.

    `due()` releases the timed faults whose moment has come (by calling `post`) and
    returns the seconds until the next one (None: none queued); it is called without
    this object's lock held, since it takes the backend's."""

    NVMLError = SimNvmlError
    NVML_ERROR_TIMEOUT = 10  # NVML's value
    nvmlEventTypeXidCriticalError = 0x8

    def __init__(self, gpus: int, due: Callable[[], float | None]) -> None:
        self.handles = tuple(SimHandle(i) for i in range(gpus))
        self._due = due
        self._cv = threading.Condition()
        self._queue: deque[list[int]] = deque()  # [index, xid, events left]

    def post(self, index: int, xid: int, count: int = 1) -> None:
        with self._cv:
            self._queue.append([index, xid, count])
            self._cv.notify()

    def kick(self) -> None:
        """A fault was queued: the waiting thread looks at the faults again."""
        with self._cv:
            self._cv.notify()

    # -- pynvml's API --------------------------------------------------------------

    def nvmlEventSetCreate(self) -> object:
        return self

    def nvmlDeviceRegisterEvents(self, h: SimHandle, types: int, evset: object) -> None:
        if not isinstance(h, SimHandle):
            raise SimNvmlError(2)  # NVML_ERROR_INVALID_ARGUMENT

    def nvmlEventSetWait(self, evset: object, timeout_ms: int) -> SimEventData:
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            next_s = self._due()
            with self._cv:
                if self._queue:
                    head = self._queue[0]
                    head[2] -= 1
                    if head[2] <= 0:
                        self._queue.popleft()
                    index, xid = head[0], head[1]
                    kind = self.nvmlEventTypeXidCriticalError
                    return SimEventData(self.handles[index], kind, xid)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SimNvmlError(self.NVML_ERROR_TIMEOUT)
                self._cv.wait(left if next_s is None else max(0.0, min(left, next_s)))

    def nvmlEventSetFree(self, evset: object) -> None:
        with self._cv:
            self._queue.clear()
