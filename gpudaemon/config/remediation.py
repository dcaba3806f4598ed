"""The `remediation` section: resetting a sick GPU in place. Read by the agent (which
runs the reset) and by the rebalancer (which drains the GPU and grants the reset within
the fleet's limits); docs/remediation.md says how the two take turns."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, Field

from gpudaemon.config.values import Number, Switch, WholeNumber, _Section

# "22:00-06:00" (UTC, every day; it may wrap past midnight).
WINDOW_PATTERN = r"^([01][0-9]|2[0-3]):[0-5][0-9]-([01][0-9]|2[0-3]):[0-5][0-9]$"


def _check_window(v: str) -> str:
    if v and not re.fullmatch(WINDOW_PATTERN, v):
        raise ValueError(
            f"maintenance_window {v!r} is not HH:MM-HH:MM in UTC (e.g. '22:00-06:00'), "
            "or empty for any time"
        )
    if v and v[:5] == v[6:]:
        raise ValueError(f"maintenance_window {v!r} is empty: its start and end are the same")
    return v


def _check_tool(v: str) -> str:
    if not v.startswith("/") or "\0" in v or len(v) > 4096:
        raise ValueError(f"nvidia_smi {v!r} must be an absolute path (the host driver's tool)")
    return v


class RemediationConfig(_Section):
    """Reset a GPU whose verdict asks for it (`reset_gpu`), once no pod holds it, and
    return it to service; escalate what a reset does not fix."""

    # Off: a reset is a privileged act on the node; the chart grants the agent the
    # capability, and the rebalancer the right to grant resets, only with this on.
    reset_gpu: Switch = False
    # The host driver's tool (`nvidia-smi --gpu-reset -i <uuid>`). With the GPU
    # Operator's driver container the host sees it under /run/nvidia/driver.
    nvidia_smi: Annotated[str, AfterValidator(_check_tool)] = "/usr/bin/nvidia-smi"
    # A reset takes seconds; one that hangs is killed and counted as failed.
    reset_timeout_s: Annotated[Number, Field(ge=5, le=600)] = 60.0
    # After the reset the GPU must read healthy for this long before it is returned.
    settle_s: Annotated[Number, Field(ge=0, le=600)] = 10.0
    # The rebalancer drains a reset_gpu GPU's pods after this (instead of
    # rebalance.grace_s): the fault does not clear without the reset that follows.
    drain_grace_s: Annotated[Number, Field(ge=0, le=86400)] = 5.0
    # GPUs in reset at once across the fleet (and never more than one per node).
    max_concurrent: Annotated[WholeNumber, Field(ge=1, le=1000)] = 2
    # The circuit breaker: no new resets while more than this share of the fleet's GPUs
    # turned unhealthy within window_s (a fleet-wide event is not fixed by resets).
    max_unhealthy_fraction: Annotated[Number, Field(gt=0, le=1)] = 0.1
    window_s: Annotated[Number, Field(ge=10, le=86400)] = 600.0
    # Resets of one GPU per 24 h; the next fault escalates to reboot_node instead.
    max_attempts: Annotated[WholeNumber, Field(ge=1, le=10)] = 2
    # When resets may start, "HH:MM-HH:MM" in UTC; empty: any time.
    maintenance_window: Annotated[
        str,
        AfterValidator(_check_window),
        Field(json_schema_extra={"pattern": WINDOW_PATTERN + "|^$"}),
    ] = ""
    # A granted reset the agent has not finished by then (it died, say) frees its slot.
    grant_ttl_s: Annotated[Number, Field(ge=30, le=3600)] = 300.0
