"""The rebalancer's section (`rebalance`); `RebalancerSettings`, the model
`gpudaemon rebalance` validates, is in programs.py."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, Field

from gpudaemon.config.values import (
    DNS1123_LABEL_PATTERN,
    DNS1123_SUBDOMAIN_PATTERN,
    ListenAddress,
    Number,
    Switch,
    WholeNumber,
    _check_dns_label,
    _check_dns_subdomain,
    _Section,
)
from gpudaemon.selector import SELECTOR_PATTERN, check_selector


class RebalanceConfig(_Section):
    """`gpudaemon rebalance`: drain pods off unhealthy GPUs, defragment for pending
    pods. Acts only with --apply (or dry_run: false); otherwise logs and emits Events."""

    dry_run: Switch = True
    listen: ListenAddress = "0.0.0.0:9447"
    # One pass every interval: drain, then defragment.
    interval_s: Annotated[Number, Field(ge=1, le=3600)] = 30.0
    # A GPU unhealthy for less than this is left alone (a transient the agent clears,
    # or a node about to be drained anyway).
    grace_s: Annotated[Number, Field(ge=0, le=86400)] = 300.0
    # Caps over any 60 s and per node per 60 s. A defragmentation plan that does not fit
    # in what is left is not started at all.
    max_evictions_per_minute: Annotated[WholeNumber, Field(ge=1, le=10_000)] = 10
    max_evictions_per_node: Annotated[WholeNumber, Field(ge=1, le=1000)] = 8
    # Leader election: the Lease `gpudaemon-rebalancer` in kubernetes.lease_namespace,
    # held by kubernetes.leader_identity; the leader renews it every third of this.
    lease_duration_s: Annotated[WholeNumber, Field(ge=5, le=3600)] = 15
    # Pods that may be moved to defragment: the annotation gpudaemon.io/rebalance="true",
    # or matching this label selector (empty: the annotation only). Draining a sick GPU
    # needs no opt-in: the pod is already on a broken device.
    selector: Annotated[
        str,
        AfterValidator(check_selector),
        Field(json_schema_extra={"pattern": SELECTOR_PATTERN}),
    ] = ""
    # How long the room made for a pending pod is kept for it: the extender turns away
    # other pods of no higher priority from that node (the evicted pods' replacements
    # first) until the pod is bound, deleted, or this runs out, or the rebalancer loses
    # its Lease. Capped at 10 minutes: a reservation holds GPUs nobody uses.
    reserve_s: Annotated[Number, Field(ge=10, le=600)] = 300.0
    # Reservations live at once (kept on the leader Lease); a plan that would need one
    # more waits until one is released. Bounds what the rebalancer can hold idle.
    max_reservations: Annotated[WholeNumber, Field(ge=1, le=256)] = 16
    # Pods of this scheduler are the ones defragmentation makes room for (the pending
    # watch selects them by spec.schedulerName; a DNS-1123 subdomain, as the API has it).
    scheduler_name: Annotated[
        str,
        AfterValidator(_check_dns_subdomain),
        Field(max_length=253, json_schema_extra={"pattern": DNS1123_SUBDOMAIN_PATTERN}),
    ] = "gpudaemon-scheduler"
    # Namespaces whose pending pods defragmentation makes room for; empty: every
    # namespace. A pod elsewhere gets no evictions and no Event (counted in
    # gpudaemon_rebalancer_skipped{reason="namespace"}). Opted-in pods may still be
    # moved from any namespace.
    namespaces: list[
        Annotated[
            str,
            AfterValidator(_check_dns_label),
            Field(max_length=63, json_schema_extra={"pattern": DNS1123_LABEL_PATTERN}),
        ]
    ] = []
