"""The Lease is written together with the agent's first labels, and an owed renewal is
retried by kube-retry within seconds (issue 17): a new or restarted agent, a re-created
Node or a failed renewal never leave the node stale until the next renewal tick. Driven
on the sink's fake API server and clock; the real API server and kube-scheduler side is
tests/integration/scheduler/test_fresh_node.py."""

from __future__ import annotations

import contextlib

from gpudaemon.errors import KubeError
from tests.unit.test_kube import ls, make


def test_the_first_labels_write_renews_the_lease_in_the_same_reconcile() -> None:
    sink, fake, _, _ = make()
    assert fake.leases == []
    assert sink.apply(ls()) is True
    assert len(fake.leases) == 1 and fake.leases[-1]["owner"]["uid"] == "u-1"


def test_a_restarted_agent_with_labels_already_in_place_still_renews_at_once() -> None:
    sink, fake, _clock, _ = make()
    sink.apply(ls())
    # A new process: same Node, labels already there; nothing to write but the Lease.
    again, _, _, _ = make()
    again.client = fake
    again.lease.client = fake  # type: ignore[assignment]
    n = len(fake.leases)
    again.apply(ls())
    assert len(fake.leases) == n + 1
    assert fake.calls[-2:] == ["lease", "apply"]  # the Lease, then fresh-since


def test_stale_data_is_not_vouched_for_at_start() -> None:
    sink, fake, _, _ = make()
    sink.set_freshness(lambda: False)
    sink.apply(ls())
    assert fake.leases == []
    assert sink.retry() is False and fake.leases == []


def test_a_failed_renewal_is_retried_by_kube_retry_after_its_backoff() -> None:
    sink, fake, clock, _ = make()
    sink.apply(ls())
    n = len(fake.leases)
    fake.fail = KubeError("connection refused", None)
    with contextlib.suppress(KubeError):
        sink.heartbeat()
    fake.fail = None
    assert sink.retry() is False  # backing off (1 s)
    clock.t += 1.5
    assert sink.retry() is True
    assert len(fake.leases) == n + 1
    assert sink.retry() is False  # paid: nothing owed any more
    assert len(fake.leases) == n + 1
