"""Which ResourceSlices count, by the one rule every program shares (kube/draslices.py,
after kube-scheduler's GatherPools in 1.37.2): the newest generation of a pool, once
complete (`resourceSliceCount` slices of it), with unique device names; and what a
device is (its `type`). The extender's counts and the agent's index agree on every case."""

from __future__ import annotations

from typing import Any

import pytest

from gpudaemon.agent.resourceslices import parse_slices
from gpudaemon.cluster.drastate import DraState
from gpudaemon.kube.draslices import BadDraObject, gather_pools, parse_slice
from tests.dra_objects import gpu_device, nvidia_slice
from tests.unit.extender.test_dra_cluster import cluster, dra_node

NODE = "n1"


def sl(gen: int, count: int, gpus: range, part: int = 0) -> dict[str, Any]:
    s = nvidia_slice(NODE, devices=[gpu_device(NODE, i) for i in gpus],
                     name=f"{NODE}-g{gen}-{part}")  # fmt: skip
    s["spec"]["pool"].update(generation=gen, resourceSliceCount=count)
    return s


CASES = [
    ("one complete slice", [sl(1, 1, range(8))], 8),
    ("two generations: the newest only", [sl(1, 1, range(8)), sl(2, 1, range(8))], 8),
    ("an older generation seen last", [sl(3, 1, range(8)), sl(2, 1, range(8))], 8),
    ("newest generation is smaller", [sl(1, 1, range(8)), sl(2, 1, range(4))], 4),
    ("incomplete: 1 of 2 slices", [sl(1, 2, range(4))], 0),
    ("complete: 2 of 2 slices", [sl(1, 2, range(4)), sl(1, 2, range(4, 8), 1)], 8),
    ("the newest generation incomplete hides the old",
     [sl(1, 1, range(8)), sl(2, 2, range(4))], 0),
    ("too many slices of a generation", [sl(1, 1, range(4)), sl(1, 1, range(4, 8), 1)], 0),
    ("a device name twice: invalid", [sl(1, 2, range(4)), sl(1, 2, range(4), 1)], 0),
]  # fmt: skip


@pytest.mark.parametrize(("objs", "gpus"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_only_the_newest_complete_generation_counts(objs: list[Any], gpus: int) -> None:
    parsed = [s for o in objs if (s := parse_slice(o)) is not None]
    assert sum(len(d) for d in gather_pools(parsed).values()) == gpus
    # The extender's store, fed in order.
    dra = DraState(lambda _node: None)
    for o in objs:
        dra.slice_event("ADDED", o)
    c = dra.counts(NODE)
    assert c is not None and c.gpus == gpus
    # The agent's index: the same devices.
    devices, _ = parse_slices(objs, NODE)
    assert len(devices) == gpus


def test_deleting_the_old_generation_changes_nothing_and_the_new_one_stays() -> None:
    dra = DraState(lambda _node: None)
    old, new = sl(1, 1, range(8)), sl(2, 1, range(8))
    dra.slice_event("ADDED", old)
    dra.slice_event("ADDED", new)
    assert dra.counts(NODE).gpus == 8  # type: ignore[union-attr]
    dra.slice_event("DELETED", old)
    assert dra.counts(NODE).gpus == 8  # type: ignore[union-attr]


def test_a_pool_in_two_generations_counts_once_in_the_extender() -> None:
    c = cluster()
    c.replace_nodes([dra_node(NODE)])
    c.dra_replace("resourceslices")([sl(1, 1, range(8)), sl(2, 1, range(8))])
    st = c.states([NODE])[NODE]
    assert st is not None and st.gpus_free == 8


@pytest.mark.parametrize(
    ("attrs", "kind"),
    [
        ({"type": {"string": "gpu"}}, "gpu"),
        ({"gpu.nvidia.com/type": {"string": "mig"}, "profile": {"string": "1g.10gb"}}, "mig"),
        ({}, ""),  # no type: not a GPU
        ({"type": {"string": "vgpu"}}, ""),
    ],
)
def test_a_device_is_a_gpu_only_by_its_type(attrs: dict[str, Any], kind: str) -> None:
    obj = sl(1, 1, range(0))
    obj["spec"]["devices"] = [{"name": "gpu-0", "attributes": attrs}]
    s = parse_slice(obj)
    assert s is not None and s.devices[0].kind == kind


@pytest.mark.parametrize(
    "device",
    [
        "x",
        {"name": "UPPER"},
        {"name": "gpu-0", "attributes": {"type": 5}},
        {"name": "gpu-0", "attributes": {"uuid": {"string": "has spaces"}}},
        {"name": "gpu-0", "taints": "NoSchedule"},
    ],
)
def test_a_malformed_device_is_skipped_and_the_rest_of_its_slice_stays(device: Any) -> None:
    obj = sl(1, 1, range(2))
    obj["spec"]["devices"].append(device)
    s = parse_slice(obj)
    assert s is not None and len(s.devices) == 2 and s.skipped == 1


@pytest.mark.parametrize(
    "pool",
    [
        {"name": NODE, "generation": 1},  # no resourceSliceCount
        {"name": NODE, "generation": 1, "resourceSliceCount": 0},
        {"name": NODE, "generation": True, "resourceSliceCount": 1},
        {"name": NODE, "generation": -1, "resourceSliceCount": 1},
        {"name": NODE, "generation": 1, "resourceSliceCount": "1"},
    ],
)
def test_a_pool_of_the_wrong_shape_is_a_bad_slice(pool: dict[str, Any]) -> None:
    obj = sl(1, 1, range(1))
    obj["spec"]["pool"] = pool
    with pytest.raises(BadDraObject):
        parse_slice(obj)
