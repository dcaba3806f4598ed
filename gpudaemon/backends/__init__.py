"""GPU backends: NVML (real hardware) and simulated, behind one interface."""

from __future__ import annotations

from gpudaemon.backends.base import Backend


def make_backend(simulate: str | None, seed: int | None = None) -> Backend:
    """Build the simulated backend for a profile name/file, or NVML when `simulate` is None."""
    if simulate:
        from gpudaemon.backends.simulated import SimulatedBackend, load_profile

        return SimulatedBackend(load_profile(simulate), seed=seed)
    from gpudaemon.backends.nvml import NvmlBackend

    return NvmlBackend()


__all__ = ["Backend", "make_backend"]
