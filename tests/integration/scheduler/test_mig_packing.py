"""MIG packing through the real kube-scheduler (issue 20, done-when 2). Three nodes
advertise nvidia.com/mig-1g.10gb (7) and nvidia.com/mig-3g.40gb (2), as the device
plugin's mixed strategy does for an A100-80GB split 7x 1g.10gb and one split 2x
3g.40gb; the third also has a whole free GPU. Real agents (simulated with that layout)
label the nodes and hold their Leases. A sequence of MIG pods through
`gpudaemon-scheduler` fills the partly used node first, keeps off the node with the
whole GPU while MIG capacity remains elsewhere, and never overcommits a profile, also
when a burst of pods arrives at once."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from tests.integration.scheduler.rig import SchedulerRig
from tests.support import wait_for

pytestmark = pytest.mark.integration

A100 = "{name: NVIDIA A100-SXM4-80GB, memory_total_mib: 81920, compute_capability: '8.0'"
LAYOUT = f"""driver_version: "550.54.15"
cuda_version: "12.4"
gpus:
  - {A100}, mig: {{enabled: true, instances: [1g.10gb, 1g.10gb, 1g.10gb, 1g.10gb, 1g.10gb, 1g.10gb, 1g.10gb]}}}}
  - {A100}, mig: {{enabled: true, instances: [3g.40gb, 3g.40gb]}}}}
"""
WHOLE = LAYOUT + f"  - {A100}, mig: {{capable: true}}}}\n"
MIG = {"nvidia.com/mig-1g.10gb": "7", "nvidia.com/mig-3g.40gb": "2"}
ONE_G, THREE_G = "nvidia.com/mig-1g.10gb", "nvidia.com/mig-3g.40gb"


@pytest.fixture
def mig_nodes(rig: SchedulerRig, tmp_path: Path) -> tuple[str, dict[str, str]]:
    group = uuid.uuid4().hex[:6]
    nodes = {k: f"{group}-{k}" for k in ("partly", "empty", "whole")}
    (tmp_path / "mig.yaml").write_text(LAYOUT)
    (tmp_path / "whole.yaml").write_text(WHOLE)
    rig.add_node(nodes["partly"], group, gpus=0, extra=MIG)
    rig.add_node(nodes["empty"], group, gpus=0, extra=MIG)
    rig.add_node(nodes["whole"], group, gpus=1, extra=MIG)
    mixed = {"mig_strategy": "mixed"}
    rig.run_agents([nodes["partly"], nodes["empty"]], str(tmp_path / "mig.yaml"), labels=mixed)
    rig.run_agents([nodes["whole"]], str(tmp_path / "whole.yaml"), labels=mixed)
    rig.wait_extender_sees(nodes.values())
    return group, nodes


def test_mig_pods_fill_the_partly_used_node_first_and_spare_whole_gpus(
    rig: SchedulerRig, mig_nodes: tuple[str, dict[str, str]]
) -> None:
    group, nodes = mig_nodes
    names = list(nodes.values())
    label = rig.cp.node(nodes["partly"])["metadata"]["labels"]
    assert label["gpudaemon.io/mig-1g.10gb.count"] == "7"  # the agent's mixed labels
    assert label["gpudaemon.io/mig-1g.10gb.memory"] == "9728"
    # The partly used node: two 1g.10gb devices already held by a pod bound at creation
    # (created unbound and then bound by hand, the scheduler could place it first).
    rig.create_mig_pod(group, "1g.10gb", 2, node=nodes["partly"])
    ext = rig.extender
    assert ext is not None
    wait_for(
        lambda: (
            ext.cluster.states([nodes["partly"]])[nodes["partly"]].mig_free  # type: ignore[union-attr]
            == {"1g.10gb": 5, "3g.40gb": 2}
        ),
        timeout=10,
        what="the bound pod in the extender's cache",
    )
    placed = []
    # One at a time: 5 fit on the partly used node, then the empty one takes over.
    for profile, count in [("1g.10gb", 1), ("1g.10gb", 2), ("3g.40gb", 1), ("1g.10gb", 2)]:
        placed.append((profile, count, rig.wait_bound(rig.create_mig_pod(group, profile, count))))
    assert [n for *_, n in placed] == [nodes["partly"]] * 4, placed
    nxt = rig.wait_bound(rig.create_mig_pod(group, "1g.10gb", 1))
    assert nxt == nodes["empty"], placed  # partly is full of 1g: the empty MIG node next
    nxt = rig.wait_bound(rig.create_mig_pod(group, "3g.40gb", 1))
    assert nxt == nodes["partly"]  # its second 3g.40gb, before the empty node's
    used = rig.requests_by_node(names, ONE_G)
    assert used == {nodes["partly"]: 7, nodes["empty"]: 1, nodes["whole"]: 0}

    # A burst of 6 + 1 pods at once: exactly what the empty node still has, then one more.
    burst = [rig.create_mig_pod(group, "1g.10gb", 1) for _ in range(7)]
    where = [rig.wait_bound(b, timeout=60) for b in burst]
    assert where.count(nodes["empty"]) == 6 and where.count(nodes["whole"]) == 1, where
    for resource, alloc in ((ONE_G, 7), (THREE_G, 2)):
        for node, n in rig.requests_by_node(names, resource).items():
            assert n <= alloc, (node, resource, n)  # never overcommitted
    # Now only the whole-GPU node has 1g.10gb left; a 3g.40gb pod still prefers MIG nodes.
    assert rig.wait_bound(rig.create_mig_pod(group, "3g.40gb", 1)) == nodes["empty"]
    # Only the whole-GPU node has 1g.10gb left: six more fit there, the seventh fits nowhere.
    last = [rig.create_mig_pod(group, "1g.10gb", 1) for _ in range(7)]
    bound = [rig.wait_bound(p, timeout=60) for p in last[:6]]
    assert set(bound) == {nodes["whole"]}
    wait_for(
        lambda: any("nvidia.com/mig-1g.10gb" in e for e in rig.events_for(last[6])),
        timeout=30,
        what="the eighth 1g.10gb pod on the whole node refused for lack of devices",
    )
    assert not rig.pod(last[6])["spec"].get("nodeName")
