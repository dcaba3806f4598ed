"""Simulated GPUs: a first-class backend for demos, tests and benchmarks.

Readings are a pure function of (seed, GPU index, poll number, elapsed time), so a
seeded run is reproducible. Faults (XID, lost GPU, ECC) fire at a configured time or
poll and behave like their NVML counterparts.

A GPU may carry a per-call latency profile (`nvml_latency_us`, microseconds per NVML
call): a sample then costs what the NVML calls the real backend makes for it cost
(`SAMPLE_CALLS`, `ENERGY_CALLS`). The time is spent once per step, as a busy wait for
the sum (NVML calls are CPU time in the driver, and one `time.sleep` per call would
charge at least ~50 us each, far more than most real calls).

The modules: `profile` (the profile's shape, its validation and loading, what each
fault needs of its GPU), `faults` (the fault kinds and their fields), `readings` (the
readings model: each GPU's state, its sample, its NVML cost), `effects` (what a fault
does to that state when it fires, and what a reset undoes) and `backend`
(SimulatedBackend).
"""

from gpudaemon.backends.simulated.backend import SimulatedBackend
from gpudaemon.backends.simulated.faults import FaultSpec
from gpudaemon.backends.simulated.profile import (
    BUILTIN_PROFILES,
    GpuSpec,
    MigChangeSpec,
    MigSpec,
    Profile,
    UtilizationSpec,
    has_gpm,
    load_profile,
    mig_layout_error,
    parse_profile,
)

__all__ = [
    "BUILTIN_PROFILES",
    "FaultSpec",
    "GpuSpec",
    "MigChangeSpec",
    "MigSpec",
    "Profile",
    "SimulatedBackend",
    "UtilizationSpec",
    "has_gpm",
    "load_profile",
    "mig_layout_error",
    "parse_profile",
]
