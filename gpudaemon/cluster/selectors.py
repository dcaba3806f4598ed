"""Which pods the programs watch, and when the scheduler gave up on one: the field
selectors and the pod condition the extender and the rebalancer read alike."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

# Bound pods that still hold resources: terminal pods free theirs (kube-scheduler's rule).
POD_SELECTOR = "spec.nodeName!=,status.phase!=Succeeded,status.phase!=Failed"


def pending_selector(scheduler_name: str) -> str:
    """Unbound pods of our scheduler: the only pods GPUs are booked for (pods.py)."""
    return f"spec.nodeName=,spec.schedulerName={scheduler_name}"


def unschedulable_since(pod: Mapping[str, Any]) -> float | None:
    """Wall time the scheduler last marked the pod unschedulable (its PodScheduled=False
    condition), or None. A gang rejected at Coscheduling's Permit shows up this way."""
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            try:
                t = datetime.fromisoformat(str(cond.get("lastTransitionTime", "")))
            except ValueError:
                return None
            return t.timestamp() if t.tzinfo else None
    return None
