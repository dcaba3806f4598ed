"""Leader election on a Lease (issue 22): one leader among replicas, takeover only
after the holder's Lease has expired, and a replica that cannot renew steps down."""

from __future__ import annotations

import pytest

from gpudaemon.kube.leader import LeaderElector
from tests.clock import FakeClock
from tests.unit.rebalancer.fake_kube import FakeKube


def electors(kube: FakeKube, clock: FakeClock, duration: int = 15) -> list[LeaderElector]:
    return [
        LeaderElector(kube, "gpudaemon", "gpudaemon-rebalancer", name, duration,  # type: ignore[arg-type]
                      wall=clock, clock=clock)
        for name in ("rb-a", "rb-b")
    ]  # fmt: skip


def test_one_leader_and_takeover_only_after_the_lease_expires() -> None:
    kube, clock = FakeKube(), FakeClock()
    a, b = electors(kube, clock)
    assert a.try_acquire_or_renew() and not b.try_acquire_or_renew()
    lease = kube.leases["gpudaemon-rebalancer"]["spec"]
    assert lease["holderIdentity"] == "rb-a" and lease["leaseDurationSeconds"] == 15
    clock.advance(10)
    assert a.try_acquire_or_renew() and not b.try_acquire_or_renew()  # renewed
    clock.advance(14)
    assert not b.try_acquire_or_renew()  # 14 s after the renewal: still a's
    # a dies (stops renewing); one lease duration after its last renewal b takes over.
    clock.advance(2)
    assert b.try_acquire_or_renew()
    spec = kube.leases["gpudaemon-rebalancer"]["spec"]
    assert spec["holderIdentity"] == "rb-b" and spec["leaseTransitions"] == 1
    assert not a.try_acquire_or_renew() and not a.leading  # back, but b holds it


def test_a_leader_that_cannot_renew_steps_down_within_its_duration() -> None:
    kube, clock = FakeKube(), FakeClock()
    a, _ = electors(kube, clock)
    assert a.try_acquire_or_renew()
    kube.down = True
    clock.advance(8)
    assert a.try_acquire_or_renew()  # API down: still inside its renew deadline (10 s)
    clock.advance(3)
    # Stepped down at 10 s, 5 s before anyone else may take the Lease (15 s).
    assert not a.try_acquire_or_renew() and not a.leading


def test_a_standby_tries_again_when_the_holders_lease_runs_out() -> None:
    kube, clock = FakeKube(), FakeClock()
    a, b = electors(kube, clock)
    assert a.try_acquire_or_renew()
    clock.advance(2)
    assert not b.try_acquire_or_renew()
    assert b.retry_in(5.0) == 5.0  # 13 s to go: the usual period
    clock.advance(10)
    assert b.retry_in(5.0) == pytest.approx(3.05)  # then exactly when it runs out
    assert a.retry_in(5.0) == 5.0


def test_a_lost_write_race_is_not_leadership() -> None:
    kube, clock = FakeKube(), FakeClock()
    a, b = electors(kube, clock)
    assert a.try_acquire_or_renew()
    assert not b.try_acquire_or_renew()  # b stands by, watching the Lease
    clock.advance(20)  # expired: both try; the second write carries a stale resourceVersion
    stale = kube.request("GET", "/apis/coordination.k8s.io/v1/namespaces/gpudaemon/leases/"
                         "gpudaemon-rebalancer")  # fmt: skip
    assert b.try_acquire_or_renew()
    orig = kube.request

    def stale_get(method: str, path: str, body: object = None, **kw: object) -> dict:  # type: ignore[type-arg]
        return stale if method == "GET" else orig(method, path, body, **kw)

    kube.request = stale_get  # type: ignore[method-assign]
    assert not a.try_acquire_or_renew()  # 409: b wrote first
    assert kube.leases["gpudaemon-rebalancer"]["spec"]["holderIdentity"] == "rb-b"


def test_release_hands_over_at_once() -> None:
    kube, clock = FakeKube(), FakeClock()
    a, b = electors(kube, clock)
    assert a.try_acquire_or_renew()
    a.release()
    assert not a.leading
    assert b.try_acquire_or_renew()  # no need to wait out the 15 s


def test_a_standby_whose_clock_runs_ahead_still_waits_for_the_leader_to_step_down() -> None:
    """renewTime is the leader's wall clock. A standby whose wall clock is a minute ahead
    sees the Lease as long expired, but waits the renew deadline (10 s of its own
    monotonic time) after it last saw the Lease change: by then the leader, which
    renewed before that, has stopped acting."""
    kube, clock = FakeKube(), FakeClock()
    a = LeaderElector(kube, "gpudaemon", "gpudaemon-rebalancer", "rb-a", 15,  # type: ignore[arg-type]
                      wall=clock, clock=clock)  # fmt: skip
    b = LeaderElector(kube, "gpudaemon", "gpudaemon-rebalancer", "rb-b", 15,  # type: ignore[arg-type]
                      wall=lambda: clock() + 60, clock=clock)  # fmt: skip
    assert a.try_acquire_or_renew()
    assert not b.try_acquire_or_renew()  # "expired" by b's wall clock, but just seen
    assert b.retry_in(5.0) == 5.0
    clock.advance(9)
    assert not b.try_acquire_or_renew() and a.leading
    assert b.retry_in(5.0) == pytest.approx(1.05)
    clock.advance(1.05)  # a did not renew: 10 s after its renewal it stops acting
    assert not a.leading
    assert b.try_acquire_or_renew()
    # A live leader keeps its Lease against that standby: each renewal is a change.
    c = LeaderElector(kube, "gpudaemon", "gpudaemon-rebalancer", "rb-c", 15,  # type: ignore[arg-type]
                      wall=lambda: clock() + 60, clock=clock)  # fmt: skip
    for _ in range(6):
        assert not c.try_acquire_or_renew()
        clock.advance(5)
        assert b.try_acquire_or_renew()


FORGED = {"holderIdentity": "evil", "renewTime": "2099-01-01T00:00:00.000000Z",
          "leaseDurationSeconds": 2**31 - 1, "acquireTime": "2099-01-01T00:00:00.000000Z"}  # fmt: skip


@pytest.mark.parametrize(
    "spec",
    [
        FORGED,
        {**FORGED, "renewTime": "2023-11-14T22:15:00.000000Z"},  # 100 s ahead of T0
        {**FORGED, "renewTime": "2023-11-14T22:13:20.000000Z"},  # now, but 2**31 - 1 s
        {**FORGED, "renewTime": "2023-11-14T22:13:20.000000Z", "leaseDurationSeconds": 3601},
    ],
)
def test_a_forged_lease_is_taken_over_within_the_duration(spec: dict[str, object]) -> None:
    """A renewTime more than a minute ahead, or a duration past an hour, is not held by
    our rules: a replica takes the Lease once its renew deadline (10 s of a 15 s
    duration) has passed since it first saw it, as from a leader that died."""
    kube, clock = FakeKube(), FakeClock()
    kube.leases["gpudaemon-rebalancer"] = {
        "metadata": {"name": "gpudaemon-rebalancer", "namespace": "gpudaemon",
                     "resourceVersion": "1"},
        "spec": dict(spec),
    }  # fmt: skip
    a, _ = electors(kube, clock)
    assert not a.try_acquire_or_renew()
    assert a.retry_in(5.0) == 5.0
    clock.advance(9.9)
    assert not a.try_acquire_or_renew()
    clock.advance(0.1)
    assert a.try_acquire_or_renew()
    got = kube.leases["gpudaemon-rebalancer"]["spec"]
    assert got["holderIdentity"] == "rb-a" and got["leaseDurationSeconds"] == 15


def test_a_live_leader_keeps_its_lease_against_a_standby_whose_clock_is_far_behind() -> None:
    """To a standby two minutes behind, every renewal is "from the future" (not held),
    but each one is a change it sees, so it waits its renew deadline anew each time."""
    kube, clock = FakeKube(), FakeClock()
    a = LeaderElector(kube, "gpudaemon", "gpudaemon-rebalancer", "rb-a", 15,  # type: ignore[arg-type]
                      wall=clock, clock=clock)  # fmt: skip
    b = LeaderElector(kube, "gpudaemon", "gpudaemon-rebalancer", "rb-b", 15,  # type: ignore[arg-type]
                      wall=lambda: clock() - 120, clock=clock)  # fmt: skip
    assert a.try_acquire_or_renew()
    for _ in range(6):
        assert not b.try_acquire_or_renew()
        clock.advance(5)
        assert a.try_acquire_or_renew()
