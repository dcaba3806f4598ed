"""The one small interface every GPU source implements: NVML, simulated, recorded."""

from __future__ import annotations

from typing import Protocol

from gpudaemon.model import GpuSample, NodeInventory

# XIDs caused by the application, not the GPU (same set as NVIDIA's device plugin):
# they are counted but do not make the GPU unhealthy.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})


def is_critical_xid(xid: int) -> bool:
    return xid not in APPLICATION_XIDS


class Backend(Protocol):
    """A source of GPU inventory and samples.

    `sample()` never raises for a single bad GPU: that GPU comes back with
    `healthy=False` and the others carry on. It raises BackendError only when the
    whole node is unreadable.
    """

    name: str

    def inventory(self) -> NodeInventory: ...

    def sample(self) -> tuple[GpuSample, ...]: ...

    def close(self) -> None: ...
