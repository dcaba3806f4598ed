"""What each XID needs, after NVIDIA's XID catalog: one row per XID, its state, its
action and where that comes from.

Source: NVIDIA, "Analyzing Xid Errors with the Xid Catalog"
(https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html), the column
"Resolution Bucket (Immediate Action)" for Ampere and later GPUs (RESTART_APP, IGNORE,
RESET_GPU, RESTART_BM, WORKFLOW_XID_48, WORKFLOW_NVLINK_ERR, ...). docs/operations.md
("GPU health") lists the rows and how the buckets map onto our actions. An XID the
table does not name keeps today's policy: an application XID (the set NVIDIA's device
plugin skips) is counted and harmless; any other makes the GPU unhealthy, reset_gpu.
"""

from __future__ import annotations

from dataclasses import dataclass

CATALOG = "NVIDIA XID catalog"

# XIDs caused by the application, not the GPU (same set as NVIDIA's device plugin):
# they are counted but do not make the GPU unhealthy.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})


@dataclass(frozen=True)
class XidRule:
    state: str  # healthy | degraded | unhealthy
    action: str  # none | watch | drain | reset_gpu | reboot_node | replace
    what: str  # the catalog's description, short
    source: str  # the catalog's resolution bucket, or our own policy


XIDS: dict[int, XidRule] = {
    # Application errors: the app restarts, the GPU is fine (RESTART_APP / IGNORE).
    13: XidRule("healthy", "none", "graphics engine exception", f"{CATALOG}: RESTART_APP"),
    31: XidRule("healthy", "none", "GPU memory page fault", f"{CATALOG}: RESTART_APP"),
    43: XidRule("healthy", "none", "GPU stopped processing", f"{CATALOG}: RESTART_APP"),
    45: XidRule("healthy", "none", "preemptive cleanup", f"{CATALOG}: IGNORE"),
    68: XidRule("healthy", "none", "NVDEC0 exception", f"{CATALOG}: RESTART_APP"),
    109: XidRule("healthy", "none", "context switch timeout", f"{CATALOG}: RESTART_APP"),
    # Memory.
    48: XidRule("unhealthy", "reset_gpu", "double bit ECC error", f"{CATALOG}: WORKFLOW_XID_48"),
    63: XidRule(
        "unhealthy", "reset_gpu", "row remap / page retirement recorded", f"{CATALOG}: RESET_GPU"
    ),
    64: XidRule(
        "unhealthy",
        "replace",
        "row remap / page retirement failed",
        f"{CATALOG}: RESET_GPU, then CONTACT_SUPPORT (out of spare rows)",
    ),
    92: XidRule("degraded", "watch", "high single-bit ECC rate", f"{CATALOG}: no immediate action"),
    94: XidRule("unhealthy", "reset_gpu", "contained ECC error", f"{CATALOG}: RESET_GPU"),
    95: XidRule("unhealthy", "reboot_node", "uncontained ECC error", f"{CATALOG}: RESTART_BM"),
    # Interconnect and bus.
    74: XidRule("unhealthy", "reset_gpu", "NVLink error", f"{CATALOG}: WORKFLOW_NVLINK_ERR"),
    79: XidRule("unhealthy", "reboot_node", "GPU fell off the bus", f"{CATALOG}: RESTART_BM"),
    # GSP firmware.
    119: XidRule("unhealthy", "reset_gpu", "GSP RPC timeout", f"{CATALOG}: RESET_GPU"),
    120: XidRule("unhealthy", "reset_gpu", "GSP error", f"{CATALOG}: RESET_GPU"),
    # The driver's recovery action changed: the action is the field's, read on this
    # event (verdict.py's recovery_action rows); the XID itself decides nothing.
    154: XidRule("healthy", "none", "GPU recovery action changed", f"{CATALOG}: read the field"),
}

# Application XIDs not in the table (none today); kept from backends/base.py.
DEFAULT_CRITICAL = XidRule(
    "unhealthy",
    "reset_gpu",
    "critical XID",
    "gpudaemon policy: any XID outside NVIDIA device plugin's application set",
)


def xid_rule(xid: int, application: frozenset[int]) -> XidRule:
    rule = XIDS.get(xid)
    if rule is not None:
        return rule
    if xid in application:
        return XidRule("healthy", "none", "application error", "NVIDIA device plugin's skip list")
    return DEFAULT_CRITICAL
