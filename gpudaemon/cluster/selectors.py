"""Which pods the programs watch, and when the scheduler gave up on one: the field
selectors and the pod condition the extender and the rebalancer read alike."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from gpudaemon.cluster.podspec import kept_pod

# Bound pods that still hold resources: terminal pods free theirs (kube-scheduler's rule).
POD_SELECTOR = "spec.nodeName!=,status.phase!=Succeeded,status.phase!=Failed"
# How both pod watches list and keep pods: each in its kept form as its page or event
# arrives, in pages of 100 rather than client-go's 500, since a tenant's pod may be up
# to etcd's 1.5 MB (one page in flight is then at most ~150 MB of JSON, once, at start
# or relist; ordinary pods are a few KB). 50,000 pods list in 500 requests.
POD_PAGE = 100
POD_FORM: dict[str, Any] = {"transform": kept_pod, "page_size": POD_PAGE}


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
