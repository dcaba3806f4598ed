"""The agent in-process against the real API server, on a simulated clock: noisy steady
load does not rewrite the Node, a lost GPU reaches it in one reconcile, and the Lease
heartbeat renews without touching the Node."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from gpudaemon.agent.app import Agent
from gpudaemon.agent.nodelabels import NodeLabelSink
from gpudaemon.backends.simulated import FaultSpec, SimulatedBackend, load_profile
from gpudaemon.config import load_config
from tests.clock import FakeClock
from tests.integration.kube.controlplane import ControlPlane, annotation

pytestmark = pytest.mark.integration

P = "gpudaemon.io/"
RECONCILE_S = 30.0  # the default labels schedule


@pytest.fixture
def agent(control_plane: ControlPlane, node: str) -> Iterator[tuple[Agent, FakeClock]]:
    clock = FakeClock(1_800_000_000.0)
    cfg = load_config(
        environ={},
        overrides={
            "node_name": node,
            "labels": {"to": "apiserver"},
            "metrics": {"listen": "127.0.0.1:0"},
            "kubernetes": {"kubeconfig": str(control_plane.agent_kubeconfig)},
        },
    )
    backend = SimulatedBackend(load_profile("dgx-h100"), seed=7, clock=clock)
    a = Agent(cfg, backend=backend, clock=clock)
    assert isinstance(a.label_sink, NodeLabelSink)
    a.label_sink.clock = clock
    try:
        yield a, clock
    finally:
        a.close()


def cycle(a: Agent, clock: FakeClock) -> None:
    clock.t += RECONCILE_S
    assert a.poll_telemetry()
    assert a.reconcile_labels()


def test_noisy_steady_load_changes_resource_version_at_most_once(
    control_plane: ControlPlane, agent: tuple[Agent, FakeClock], node: str
) -> None:
    a, clock = agent
    assert a.run_once()
    versions = [control_plane.node(node)["metadata"]["resourceVersion"]]
    utils: list[float] = []
    for _ in range(20):
        cycle(a, clock)
        versions.append(control_plane.node(node)["metadata"]["resourceVersion"])
        s = a.cache.get().samples[0].gpu_utilization_ratio
        assert s is not None
        utils.append(s)
    changes = sum(1 for x, y in itertools.pairwise(versions) if x != y)
    assert changes <= 1, versions
    assert max(utils) - min(utils) > 0.05, "the simulated load was not noisy"
    assert len(annotation(control_plane.node(node))) == 8
    reg = a.registry
    assert reg.get_sample_value("gpudaemon_node_writes_total", {"result": "error"}) == 0
    # No wasted requests either: every PATCH the sink sent changed the Node (the first
    # labels, `fresh-since` after the first Lease renewal, issue 17, and the changes).
    sent = reg.get_sample_value("gpudaemon_node_writes_total", {"result": "success"})
    assert sent == 2 + changes
    assert reg.get_sample_value("gpudaemon_last_reconcile_timestamp_seconds") == clock.t


def test_lost_gpu_reaches_label_and_annotation_within_one_reconcile(
    control_plane: ControlPlane, agent: tuple[Agent, FakeClock], node: str
) -> None:
    a, clock = agent
    assert a.run_once()
    assert control_plane.node(node)["metadata"]["labels"][P + "gpu.healthy"] == "8"
    assert isinstance(a.backend, SimulatedBackend)
    a.backend.inject(3, FaultSpec(kind="lost"))
    cycle(a, clock)  # one telemetry poll and one reconcile
    n = control_plane.node(node)
    assert n["metadata"]["labels"][P + "gpu.healthy"] == "7"
    gpus = {g["index"]: g for g in annotation(n)}
    assert gpus[3]["healthy"] is False and gpus[3]["reason"] == "gpu lost"
    assert sorted(gpus) == list(range(8))
    assert all(gpus[i]["healthy"] for i in gpus if i != 3)


def test_lease_heartbeat_renews_without_rewriting_the_node(
    control_plane: ControlPlane, agent: tuple[Agent, FakeClock], node: str
) -> None:
    a, clock = agent
    assert a.run_once()
    sink = a.label_sink
    assert isinstance(sink, NodeLabelSink)
    rv = control_plane.node(node)["metadata"]["resourceVersion"]
    assert sink.heartbeat()
    first = control_plane.lease(node)
    assert first is not None
    spec = first["spec"]
    assert (
        spec["leaseDurationSeconds"] == a.cfg.kubernetes.lease_duration_seconds
        and spec["holderIdentity"]
    )
    owner = first["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"]) == ("Node", node)
    clock.t += 10
    a.poll_telemetry()
    assert sink.heartbeat()
    second = control_plane.lease(node)
    assert second is not None
    assert second["spec"]["renewTime"] > spec["renewTime"]
    assert control_plane.node(node)["metadata"]["resourceVersion"] == rv
    # Stale data: the heartbeat stops, so the Lease expires and schedulers stop trusting.
    clock.t += 60
    assert not sink.heartbeat()
    third = control_plane.lease(node)
    assert third is not None and third["spec"]["renewTime"] == second["spec"]["renewTime"]
