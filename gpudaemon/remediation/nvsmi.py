"""The host driver's reset tool: `nvidia-smi --gpu-reset -i <uuid>`, run with a timeout,
its exit status read as nvidia-smi(1) documents it ("RETURN VALUE").

What the tool itself requires (nvidia-smi(1), `-r, --gpu-reset`): root; no process on
the GPU (a CUDA or graphics application, another nvidia-smi); before Ampere, and on
Ampere NVSwitch systems without Fabric Manager, every NVLink peer reset in the same
command. `can_reset_alone` keeps the agent to GPUs that can go alone."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass

from gpudaemon.model import GpuInfo

# nvidia-smi(1), RETURN VALUE.
EXIT_CODES: dict[int, str] = {
    0: "success",
    2: "a supplied argument or flag is invalid",
    3: "the requested operation is not available on the target device",
    4: "the current user may not access this device or perform this operation",
    6: "a query to find an object was unsuccessful",
    8: "a device's external power cables are not properly attached",
    9: "the NVIDIA driver is not loaded",
    10: "the NVIDIA kernel detected an interrupt issue with a GPU",
    12: "the NVML shared library could not be found or loaded",
    13: "the local NVML does not implement this function",
    14: "the infoROM is corrupted",
    15: "the GPU has fallen off the bus or has otherwise become inaccessible",
    255: "other error or internal driver error",
}
# Exit statuses that say the GPU was in use: not a failed reset, a refused one.
IN_USE_MARKERS = ("in use by another client", "being used by some other process")
MAX_OUTPUT = 2048


@dataclass(frozen=True)
class ToolResult:
    ok: bool
    busy: bool  # the tool refused: something uses the GPU
    code: int | None  # None: it did not run to the end (missing, timed out)
    message: str  # one line: the tool's own words, or why it did not run


def can_reset_alone(info: GpuInfo) -> bool:
    """A GPU without NVLink resets alone; with NVLink only from Ampere on (Ampere
    NVSwitch systems need Fabric Manager running, which the tool checks)."""
    return not info.nvlink_links or info.compute_capability >= (8, 0)


def reset(tool: str, uuid: str, timeout_s: float) -> ToolResult:
    """Run the reset of one GPU; never raises."""
    argv = [tool, "--gpu-reset", "-i", uuid]
    try:
        done = subprocess.run(
            argv,
            capture_output=True,
            timeout=timeout_s,
            check=False,
            env={"PATH": os.defpath, "LC_ALL": "C"},
            stdin=subprocess.DEVNULL,
        )
    except FileNotFoundError:
        return ToolResult(False, False, None, f"{tool} not found (remediation.nvidia_smi)")
    except PermissionError:
        return ToolResult(False, False, None, f"{tool} is not executable")
    except subprocess.TimeoutExpired:
        return ToolResult(False, False, None, f"{tool} did not finish in {timeout_s:.0f} s")
    except OSError as e:
        return ToolResult(False, False, None, f"{tool}: {e.strerror or e}")
    out = (done.stdout + done.stderr)[:MAX_OUTPUT].decode("utf-8", "replace")
    said = " ".join(out.split())[:300]
    if done.returncode == 0:
        return ToolResult(True, False, 0, said or "reset")
    busy = any(m in out.lower() for m in IN_USE_MARKERS)
    meaning = EXIT_CODES.get(done.returncode, "an exit status nvidia-smi does not document")
    return ToolResult(False, busy, done.returncode,
                      f"exit {done.returncode} ({meaning}): {said}" if said else
                      f"exit {done.returncode} ({meaning})")  # fmt: skip
