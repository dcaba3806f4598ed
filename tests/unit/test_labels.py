"""The label set the brief names, computed from the cache; annotations that don't churn."""

import json

import pytest

from gpudaemon.agent.cache import Cache
from gpudaemon.backends.simulated import FaultSpec, SimulatedBackend, load_profile, parse_profile
from gpudaemon.labels import NodeLabeler
from gpudaemon.labels.sanitize import is_valid_value
from gpudaemon.model import Snapshot

P = "gpudaemon.io/"
BRIEF_LABELS = {
    "gpu.present",
    "gpu.count",
    "gpu.product",
    "gpu.family",
    "gpu.memory",
    "gpu.compute.major",
    "gpu.compute.minor",
    "cuda.driver.major",
    "cuda.driver.minor",
    "cuda.driver.rev",
    "cuda.runtime.major",
    "cuda.runtime.minor",
    "gpu.healthy",
    "mig.capable",
    "mig.enabled",
}


def snapshot(backend: SimulatedBackend) -> Snapshot:
    cache = Cache()
    cache.put_inventory(backend.inventory())
    return cache.put_samples(backend.sample())


def test_dgx_h100_labels() -> None:
    ls = NodeLabeler().build(snapshot(SimulatedBackend(load_profile("dgx-h100"))))
    assert {k.removeprefix(P) for k in ls.labels} >= BRIEF_LABELS
    assert ls.labels[P + "gpu.product"] == "NVIDIA-H100-80GB-HBM3"
    assert ls.labels[P + "gpu.count"] == "8" and ls.labels[P + "gpu.healthy"] == "8"
    assert ls.labels[P + "gpu.memory"] == "81559" and ls.labels[P + "gpu.family"] == "hopper"
    assert (ls.labels[P + "cuda.driver.major"], ls.labels[P + "cuda.driver.minor"]) == ("550", "54")
    assert (ls.labels[P + "cuda.runtime.major"], ls.labels[P + "cuda.runtime.minor"]) == ("12", "4")
    assert ls.labels[P + "mig.enabled"] == "false"
    gpus = json.loads(ls.annotations[P + "gpus"])
    assert [g["index"] for g in gpus] == list(range(8))
    assert set(gpus[0]) >= {
        "uuid",
        "memory_total_mib",
        "memory_used_mib",
        "utilization_pct",
        "temperature_c",
        "healthy",
        "processes",
    }
    assert len(ls.labels) > 10 and all(is_valid_value(v) for v in ls.labels.values())


def test_mig_and_mixed_labels() -> None:
    mig = NodeLabeler().build(snapshot(SimulatedBackend(load_profile("a100-mig")))).labels
    assert (mig[P + "mig.capable"], mig[P + "mig.enabled"]) == ("true", "true")
    assert mig[P + "gpu.family"] == "ampere"
    mixed = NodeLabeler().build(snapshot(SimulatedBackend(load_profile("mixed")))).labels
    assert mixed[P + "gpu.count"] == "5" and mixed[P + "gpu.mixed"] == "true"
    assert mixed[P + "gpu.product"] == "NVIDIA-A100-SXM4-40GB"  # most common; ties -> lowest index


def test_custom_prefix() -> None:
    ls = NodeLabeler("example.com/").build(snapshot(SimulatedBackend(load_profile("dgx-h100"))))
    keys = [*ls.labels, *ls.annotations]
    assert len(keys) > 10 and all(k.startswith("example.com/") for k in keys)


def test_lost_gpu_changes_health_label_and_annotation() -> None:
    b = SimulatedBackend(load_profile("dgx-h100"))
    labeler = NodeLabeler()
    labeler.build(snapshot(b))
    b.inject(5, FaultSpec(kind="lost"))
    ls = labeler.build(snapshot(b))
    assert ls.labels[P + "gpu.healthy"] == "7" and ls.labels[P + "gpu.count"] == "8"
    g5 = json.loads(ls.annotations[P + "gpus"])[5]
    assert g5["healthy"] is False and g5["reason"] == "gpu lost"


def test_noisy_steady_load_settles_once_then_never_changes() -> None:
    b = SimulatedBackend(load_profile("dgx-h100"), seed=3)
    cache, labeler = Cache(), NodeLabeler()
    cache.put_inventory(b.inventory())
    warmup = labeler.annotator.q.warmup_readings
    seen = []
    for _ in range(200):
        cache.put_samples(b.sample())
        ls = labeler.build(cache.get())
        seen.append((tuple(sorted(ls.labels.items())), ls.annotations[P + "gpus"]))
    changes = [i for i in range(1, len(seen)) if seen[i] != seen[i - 1]]
    # GPM's sm_active_pct appears with the second poll (a pair needs two samples), then
    # only the one settling re-base, at the same reconcile for every reading.
    assert changes in ([1], [1, warmup - 1])
    assert "sm_active_pct" in json.loads(seen[-1][1])[0]
    assert len({labels for labels, _ in seen}) == 1  # labels never move with load


IDLE = "gpus: [{name: X, memory_total_mib: 1000, compute_capability: '9.0', utilization: {pattern: idle}}]"


def _utilization_trace(idle_reconciles: int, busy_reconciles: int) -> list[int]:
    """The published utilization of one GPU that goes from idle to busy."""
    labeler = NodeLabeler()
    idle_b = SimulatedBackend(parse_profile(IDLE))
    busy_b = SimulatedBackend(parse_profile(IDLE.replace("idle", "busy")))
    assert idle_b.inventory().gpus[0].uuid == busy_b.inventory().gpus[0].uuid  # same GPU
    out = []
    for b in [idle_b] * idle_reconciles + [busy_b] * busy_reconciles:
        out.append(
            json.loads(labeler.build(snapshot(b)).annotations[P + "gpus"])[0]["utilization_pct"]
        )
    return out


def test_a_real_load_change_moves_the_annotation_on_the_next_reconcile() -> None:
    trace = _utilization_trace(idle_reconciles=12, busy_reconciles=6)
    assert trace[:12] == [0] * 12
    assert trace[12] > 0  # the first reconcile after the change moves it
    assert trace[-1] >= 97 - 15 - 5  # within a band and half a step of the new load


def test_during_warmup_a_large_change_still_shows_within_two_reconciles() -> None:
    trace = _utilization_trace(idle_reconciles=2, busy_reconciles=6)
    assert trace[:2] == [0, 0]
    assert trace[3] > 0 and trace[-1] >= 97 - 30 - 5  # doubled band during warm-up


def test_no_inventory_no_labels() -> None:
    ls = NodeLabeler().build(Snapshot())
    assert dict(ls.labels) == {} and ls.annotations == {}


def test_unclean_names_in_a_profile_still_give_valid_labels() -> None:
    prof = parse_profile(
        "gpus: [{name: 'NVIDIA H100 (SXM5) 80GB / HBM3 — engineering sample, rev. B2 [do not ship]',"
        " memory_total_mib: 81559, compute_capability: '9.0'}]"
    )
    ls = NodeLabeler().build(snapshot(SimulatedBackend(prof)))
    assert ls.labels and all(is_valid_value(v) for v in ls.labels.values())
    assert len(ls.labels[P + "gpu.product"]) <= 63


def test_the_gpus_annotation_decodes_to_what_was_encoded() -> None:
    from gpudaemon.labels.annotations import GpuState, decode_gpus

    b = SimulatedBackend(load_profile("a100-mig"), seed=1)
    b.inject(2, FaultSpec(kind="lost"))
    snap = snapshot(b)
    text = NodeLabeler().build(snap).annotations[P + "gpus"]
    states = decode_gpus(text)
    assert snap.inventory is not None
    assert [s.uuid for s in states] == [g.uuid for g in snap.inventory.gpus]
    lost = states[2]
    assert lost == GpuState(
        index=2,
        uuid=lost.uuid,
        memory_total_mib=snap.inventory.gpus[2].memory_total_mib,
        healthy=False,
        reason="gpu lost",
        state="unhealthy",
        action="reboot_node",
        mig_devices=7,
    )  # no readings: absent, not 0
    ok = states[0]
    assert ok.healthy and ok.mig_devices == 7 and ok.utilization_pct is not None
    assert (ok.state, ok.action, ok.reason) == ("healthy", "none", "")
    assert ok.memory_used_mib is not None and ok.temperature_c is not None


def test_decoding_refuses_a_value_with_a_malformed_entry_and_non_lists() -> None:
    """All or nothing (issue 28): skipping the one bad entry could hide an unhealthy GPU;
    the hostile cases are in test_untrusted.py."""
    from gpudaemon.labels.annotations import decode_gpus

    good = '{"index": 0, "uuid": "GPU-a", "memory_total_mib": 10}'
    assert [s.uuid for s in decode_gpus(f"[{good}]")] == ["GPU-a"]
    for bad in (f'[{good}, {{"index": "x"}}]', f"[{good}, 3]"):
        with pytest.raises(ValueError):
            decode_gpus(bad)
    with pytest.raises(ValueError):
        decode_gpus('{"index": 0}')
    with pytest.raises(ValueError):
        decode_gpus("not json")


# What GPU Feature Discovery writes for eight H100 SXM5 80GB on driver 550.54.15 / CUDA
# 12.4 (its README's label list and meanings: gpu.product with spaces as dashes, memory in
# MiB, family from the compute capability, cuda.driver.* the driver version, cuda.runtime.*
# the CUDA version).
GFD_DGX_H100 = {
    "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
    "nvidia.com/gpu.count": "8",
    "nvidia.com/gpu.memory": "81559",
    "nvidia.com/gpu.family": "hopper",
    "nvidia.com/gpu.compute.major": "9",
    "nvidia.com/gpu.compute.minor": "0",
    "nvidia.com/cuda.driver.major": "550",
    "nvidia.com/cuda.driver.minor": "54",
    "nvidia.com/cuda.driver.rev": "15",
    "nvidia.com/cuda.runtime.major": "12",
    "nvidia.com/cuda.runtime.minor": "4",
    "nvidia.com/mig.capable": "true",
}


def test_with_the_nvidia_prefix_the_labels_are_the_ones_gfd_writes() -> None:
    """`labelPrefix: nvidia.com/` is a drop-in for GFD (issue 18): for the same GPUs, the
    keys GFD writes carry GFD's values."""
    ls = NodeLabeler("nvidia.com/").build(snapshot(SimulatedBackend(load_profile("dgx-h100"))))
    assert {k: ls.labels[k] for k in GFD_DGX_H100 if k in ls.labels} == GFD_DGX_H100


def test_gpu_memory_min_is_the_smallest_gpu_of_any_model() -> None:
    ls = NodeLabeler().build(snapshot(SimulatedBackend(load_profile("mixed"))))
    assert int(ls.labels[P + "gpu.memory.min"]) < int(ls.labels[P + "gpu.memory"])
    assert ls.labels[P + "gpu.mixed"] == "true"


def test_the_gpus_annotation_names_the_pods_holding_each_gpu() -> None:
    """Issue 22: the rebalancer drains a sick GPU's pods, read from this annotation."""
    from gpudaemon.labels.annotations import decode_gpus
    from gpudaemon.model import PodRef

    snap = snapshot(SimulatedBackend(load_profile("dgx-h100"), seed=1))
    assert snap.inventory is not None
    uuid = snap.inventory.gpus[2].uuid
    pods = {uuid: PodRef(pod="train-0", namespace="ml", container="c")}
    states = decode_gpus(NodeLabeler().build(snap, pods).annotations[P + "gpus"])
    assert states[2].pods == ("ml/train-0",)
    assert all(s.pods == () for i, s in enumerate(states) if i != 2)
    text = NodeLabeler().build(snap).annotations[P + "gpus"]
    assert '"pods"' not in text  # no pod-resources answer: absent, not "free"
