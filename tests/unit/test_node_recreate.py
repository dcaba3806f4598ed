"""A Node deleted and re-created under the same name (issue 12 item 13), and a missing
Node's log lines (item 14), on the sink's fake API server and a driven clock. The same
behaviour against the real API server is in tests/integration/kube/test_recreate.py."""

from __future__ import annotations

from typing import Any

import pytest

from gpudaemon.agent.app import Agent
from gpudaemon.backends.simulated import SimulatedBackend, load_profile
from gpudaemon.config import load_config
from gpudaemon.errors import KubeNotFoundError
from tests.unit.test_kube import FakeClient, ls, make


class Recreatable(FakeClient):
    """FakeClient whose Node can vanish (404) and come back with a new UID and none
    of our labels, like `kubectl delete node` followed by the kubelet registering."""

    def __init__(self) -> None:
        super().__init__()
        self.uid = "u-1"
        self.missing = False

    def _node_exists(self, name: str) -> None:
        if self.missing:
            raise KubeNotFoundError(
                f'GET /api/v1/nodes/{name}: HTTP 404: nodes "{name}" not found', 404
            )

    def get_node(self, name: str, cached: bool = False) -> dict[str, Any]:
        node = super().get_node(name, cached)
        self._node_exists(name)
        node["metadata"]["uid"] = self.uid
        return node

    def apply_node(self, name: str, labels: dict[str, str], ann: dict[str, str]) -> Any:
        self._node_exists(name)
        super().apply_node(name, labels, ann)
        return {"metadata": {"uid": self.uid}}

    def recreate(self, uid: str) -> None:
        self.uid, self.missing = uid, False
        self.labels, self.annotations, self.owned = {"team": "ml"}, {}, (set(), set())


def recreatable_sink() -> tuple[Any, Recreatable, Any]:
    sink, _, clock, _ = make()
    fake = Recreatable()
    sink.client = fake
    sink.lease.client = fake  # type: ignore[assignment]
    return sink, fake, clock


def test_recreated_node_is_relabelled_and_lease_reowned_at_the_next_renewal(
    lines: list[tuple[str, str]],
) -> None:
    """No-op reconciles do not read the Node (issue 19); the heartbeat's read, one per
    renewal period, notices the new UID, and kube-retry relabels and re-owns a second
    later."""
    sink, fake, clock = recreatable_sink()
    assert sink.apply(ls()) is True
    assert sink.heartbeat() is True
    assert fake.leases[-1]["owner"]["uid"] == "u-1"
    fake.recreate("u-2")
    clock.t += 30
    leases_before = len(fake.leases)
    assert sink.apply(ls()) is False  # a no-op reconcile: no read, so not noticed yet
    clock.t += 90
    assert sink.heartbeat() is False  # the renewal tick reads the Node: a new UID
    assert len(fake.leases) == leases_before  # never vouches for the new Node unwritten
    clock.t += 1
    assert sink.retry() is True
    assert fake.labels["gpudaemon.io/gpu.count"] == "8"
    assert len(fake.leases) == leases_before + 1
    assert fake.leases[-1]["owner"]["uid"] == "u-2"
    assert sum("re-created (uid u-1 -> u-2)" in m for _, m in lines) == 1


def test_heartbeat_never_vouches_for_a_node_it_has_not_written() -> None:
    sink, fake, clock = recreatable_sink()
    sink.apply(ls())
    sink.heartbeat()
    fake.recreate("u-2")
    n = len(fake.leases)
    assert sink.heartbeat() is False  # before any reconcile saw the new Node
    assert len(fake.leases) == n
    clock.t += 1
    assert sink.retry() is True  # kube-retry, one second later: labels, then the Lease
    assert fake.leases[-1]["owner"]["uid"] == "u-2"
    assert sink.heartbeat() is True and fake.leases[-1]["owner"]["uid"] == "u-2"


def test_a_missing_node_is_one_line_when_it_goes_and_one_when_it_is_back(
    lines: list[tuple[str, str]],
) -> None:
    sink, fake, clock = recreatable_sink()
    cfg = load_config(environ={}, overrides={"node_name": "n1", "labels": {"to": "none"}})
    agent = Agent(
        cfg,
        backend=SimulatedBackend(load_profile("dgx-h100"), clock=clock),
        label_sink=sink,
        clock=clock,
    )
    sink.set_freshness(lambda: True)
    assert agent.run_once()
    lines.clear()
    failed = 0
    for second in range(1, 901):  # 15 minutes: the Node is gone from 1 min to 11 min
        clock.t += 1
        if second == 60:
            fake.missing = True
        if second == 660:
            fake.recreate("u-2")
        ok = agent.run_job("kube-retry")
        if second % 30 == 0:
            agent.poll_telemetry()
            ok = agent.run_job("labels") and ok
        if second % 120 == 0:
            ok = agent.run_job("lease") and ok
        failed += not ok
    assert failed >= 10  # it kept trying (and counting) all along
    ours = [(lvl, m) for lvl, m in lines if "n1" in m or "labels" in m or "lease" in m]
    assert [lvl for lvl, _ in ours] == ["WARNING", "WARNING", "INFO"], ours
    assert 'HTTP 404: nodes "n1" not found' in ours[0][1]
    assert "re-created" in ours[1][1]
    assert "labels written after" in ours[2][1]
    assert fake.leases[-1]["owner"]["uid"] == "u-2"
    agent.close()


def test_a_lease_outage_is_one_line_when_it_starts_and_one_when_it_ends(
    lines: list[tuple[str, str]],
) -> None:
    from gpudaemon.errors import KubeError, KubeUnavailableError

    sink, fake, clock = recreatable_sink()
    sink.apply(ls())
    lines.clear()
    fake.fail = KubeUnavailableError("connection refused")
    for _ in range(5):
        clock.t += 120
        with pytest.raises(KubeError) as e:
            sink.heartbeat()
        assert e.value.reported  # logged here once: the job wrapper only counts it
    fake.fail = None
    assert sink.heartbeat() is True
    assert sink.heartbeat() is True
    assert [lvl for lvl, _ in lines] == ["WARNING", "INFO"], lines
    assert "lease not renewed" in lines[0][1] and "connection refused" in lines[0][1]
    assert lines[1][1] == "node n1: lease renewed again"


def test_a_recreated_node_is_not_vouched_for_while_the_data_is_stale() -> None:
    sink, fake, clock = recreatable_sink()
    fresh = [True]
    sink.set_freshness(lambda: fresh[0])
    sink.apply(ls())
    sink.heartbeat()
    fake.recreate("u-2")
    fresh[0] = False  # NVML stuck: the Lease is not renewed, so nothing reads the Node
    clock.t += 120
    n = len(fake.leases)
    assert sink.heartbeat() is False and len(fake.leases) == n
    fresh[0] = True
    assert sink.heartbeat() is False  # fresh again: the read finds the new Node
    clock.t += 1
    assert sink.retry() is True and fake.leases[-1]["owner"]["uid"] == "u-2"
    assert len(fake.leases) == n + 1


def test_a_change_written_to_a_recreated_node_re_owns_the_lease(
    lines: list[tuple[str, str]],
) -> None:
    sink, fake, clock = recreatable_sink()
    sink.apply(ls())
    sink.heartbeat()
    fake.recreate("u-2")
    clock.t += 30
    assert sink.apply(ls(count=7)) is True  # a real change, written straight away
    assert fake.leases[-1]["owner"]["uid"] == "u-2"
    assert sum("re-created (uid u-1 -> u-2)" in m for _, m in lines) == 1
