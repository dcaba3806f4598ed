"""The names of the health signals, in the words the metrics, the annotation and the
simulator's profiles use, and how NVML's codes map onto them. Converted once, at the
backend boundary: the rest of the product sees only these names."""

from __future__ import annotations

# nvmlGpuRecoveryAction_t (NVML_FI_DEV_GET_GPU_RECOVERY_ACTION), by value. Values a
# newer driver adds (IMEX domain, bus reset, system reboot) are named by their number.
RECOVERY_ACTIONS: dict[int, str] = {
    0: "none",
    1: "gpu_reset",
    2: "node_reboot",
    3: "drain_p2p",
    4: "drain_and_reset",
}
RECOVERY_ACTION_NAMES = tuple(RECOVERY_ACTIONS.values())

# nvmlClocksEventReasons bits that mean the GPU is slowed by a fault, not by policy
# (idle, application clocks, SW power cap and sync boost are normal operation).
CLOCK_EVENT_BITS: dict[str, int] = {
    "hw_slowdown": 0x08,
    "sw_thermal": 0x20,
    "hw_thermal": 0x40,
    "hw_power_brake": 0x80,
}
CLOCK_EVENT_REASONS = tuple(CLOCK_EVENT_BITS)

# The throttle-duration fields (nanoseconds since the driver loaded), by reason; the
# constant's name in nvidia-ml-py (their numbers moved between releases, so the
# installed binding's value is used, never a number of ours). NVML has no duration
# field for HW slowdown.
CLOCK_EVENT_DURATION_FIELDS: dict[str, str] = {
    "sw_thermal": "NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN",
    "hw_thermal": "NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN",
    "hw_power_brake": "NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN",
}
RECOVERY_ACTION_FIELD = "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION"
RECOVERY_ACTION_FIELD_ID = 230  # nvml.h, when the binding predates the constant

# nvmlNvLinkErrorCounter_t, by the name the metric's `type` label carries.
NVLINK_ERROR_COUNTERS: dict[str, int] = {
    "replay": 0,  # NVML_NVLINK_ERROR_DL_REPLAY
    "recovery": 1,  # NVML_NVLINK_ERROR_DL_RECOVERY
    "crc_flit": 2,  # NVML_NVLINK_ERROR_DL_CRC_FLIT
    "crc_data": 3,  # NVML_NVLINK_ERROR_DL_CRC_DATA
}
NVLINK_ERROR_TYPES = tuple(NVLINK_ERROR_COUNTERS)
NVLINK_MAX_LINKS = 18  # when the binding lacks NVML_NVLINK_MAX_LINKS (H100: 18 links)


def recovery_action_name(code: int) -> str:
    return RECOVERY_ACTIONS.get(code, f"action_{code}")


def clock_events(mask: int) -> frozenset[str]:
    """The fault reasons set in an nvmlClocksEventReasons mask."""
    return frozenset(name for name, bit in CLOCK_EVENT_BITS.items() if mask & bit)
