"""The only package that talks to NVML (through nvidia-ml-py's `pynvml`).

Owns: lazy init under a lock, shutdown, versioned-symbol fallbacks (probed once),
unit conversion (mW -> W, mJ -> J, MHz -> Hz, percent -> ratio), "not supported" ->
None, GPU-lost isolation, and the XID event thread.

Cost (measured on an H100, ../docs/benchmarks.md): every telemetry call takes 2-10 us,
but the energy counter takes ~3.9 ms, so it is read by `energy()` on its own slower
schedule, never by `sample()`. The calls each step makes are `SAMPLE_CALLS` and
`ENERGY_CALLS` (backends/base.py); the simulator charges its latency profile for the
same ones. A reading a GPU does not support is asked once, then not again; the first
read of each reading on each GPU is timed, and one over SLOW_CALL_S is logged.

GPM (Hopper+; issue 33): support is probed once per GPU at inventory. Each sample of a
GPU with GPM takes one GPM sample and computes the metrics from it and the previous
poll's (so the pair spans the poll interval, no extra wait; the first poll has none);
with MIG on, the same per GPU instance. The arithmetic is in backends/gpm.py.

The modules: `library` (loading pynvml, init and shutdown, the call wrapper that maps
NVML's errors, first-read probes, GPM buffers, the XID event thread), `backend` (the
Backend: inventory, per-GPU samples, energy), `healthreads` (the health signals) and
`gpmreads` (GPM sampling). Only these modules call pynvml
(tests/unit/test_nvml_names.py scans all of them).
"""

from gpudaemon.backends.nvml.backend import NvmlBackend

__all__ = ["NvmlBackend"]
