"""MIG labels against what GPU Feature Discovery writes (issue 20, done-when 1): for a
simulated A100-80GB node and a simulated H100-80GB node, under the mixed and single
strategies, with `labelPrefix: nvidia.com/`, the MIG keys and values are GFD's. The
expected values are written out by hand from `nvidia-smi mig -lgip` (memory in MiB,
SMs, slices, engines), not computed from the simulator's table."""

from __future__ import annotations

import pytest

from gpudaemon.agent.cache import Cache
from gpudaemon.backends.simulated import SimulatedBackend, parse_profile
from gpudaemon.labels import NodeLabeler
from gpudaemon.model import Snapshot
from tests.clock import FakeClock

N = "nvidia.com/"


def snap(text: str) -> Snapshot:
    sim = SimulatedBackend(parse_profile(text))
    cache = Cache()
    cache.put_inventory(sim.inventory())
    return cache.put_samples(sim.sample())


def labels(text: str, strategy: str) -> dict[str, str]:
    return dict(NodeLabeler(N, mig_strategy=strategy).build(snap(text)).labels)


A100 = "{name: NVIDIA A100-SXM4-80GB, memory_total_mib: 81920, compute_capability: '8.0'"
H100 = "{name: NVIDIA H100 80GB HBM3, memory_total_mib: 81559, compute_capability: '9.0'"

# GPU 0 as 7x 1g.10gb, GPU 1 as 2x 3g.40gb (the example), on each model.
A100_MIXED = f"""gpus:
  - {A100}, mig: {{enabled: true, instances: [1g.10gb, 1g.10gb, 1g.10gb, 1g.10gb, 1g.10gb, 1g.10gb, 1g.10gb]}}}}
  - {A100}, mig: {{enabled: true, instances: [3g.40gb, 3g.40gb]}}}}
"""
H100_MIXED = A100_MIXED.replace(A100, H100)


def mig_keys(ls: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in ls.items() if k.startswith((N + "mig-", N + "mig."))}


def test_mixed_a100_80gb_is_what_gfd_writes() -> None:
    assert mig_keys(labels(A100_MIXED, "mixed")) == {
        N + "mig.capable": "true",
        N + "mig.enabled": "true",
        N + "mig.strategy": "mixed",
        N + "mig-1g.10gb.product": "NVIDIA-A100-SXM4-80GB-MIG-1g.10gb",
        N + "mig-1g.10gb.count": "7",
        N + "mig-1g.10gb.replicas": "1",
        N + "mig-1g.10gb.sharing-strategy": "none",
        N + "mig-1g.10gb.memory": "9728",
        N + "mig-1g.10gb.multiprocessors": "14",
        N + "mig-1g.10gb.slices.gi": "1",
        N + "mig-1g.10gb.slices.ci": "1",
        N + "mig-1g.10gb.engines.copy": "1",
        N + "mig-1g.10gb.engines.decoder": "0",
        N + "mig-1g.10gb.engines.encoder": "0",
        N + "mig-1g.10gb.engines.jpeg": "0",
        N + "mig-1g.10gb.engines.ofa": "0",
        N + "mig-3g.40gb.product": "NVIDIA-A100-SXM4-80GB-MIG-3g.40gb",
        N + "mig-3g.40gb.count": "2",
        N + "mig-3g.40gb.replicas": "1",
        N + "mig-3g.40gb.sharing-strategy": "none",
        N + "mig-3g.40gb.memory": "40192",
        N + "mig-3g.40gb.multiprocessors": "42",
        N + "mig-3g.40gb.slices.gi": "3",
        N + "mig-3g.40gb.slices.ci": "3",
        N + "mig-3g.40gb.engines.copy": "3",
        N + "mig-3g.40gb.engines.decoder": "2",
        N + "mig-3g.40gb.engines.encoder": "0",
        N + "mig-3g.40gb.engines.jpeg": "0",
        N + "mig-3g.40gb.engines.ofa": "0",
    }


def test_mixed_h100_is_what_gfd_writes_and_keeps_the_whole_gpu_labels() -> None:
    ls = labels(H100_MIXED, "mixed")
    assert {k: v for k, v in mig_keys(ls).items() if ".1g.10gb." in k or "mig-1g" in k} == {
        N + "mig-1g.10gb.product": "NVIDIA-H100-80GB-HBM3-MIG-1g.10gb",
        N + "mig-1g.10gb.count": "7",
        N + "mig-1g.10gb.replicas": "1",
        N + "mig-1g.10gb.sharing-strategy": "none",
        N + "mig-1g.10gb.memory": "9984",
        N + "mig-1g.10gb.multiprocessors": "16",
        N + "mig-1g.10gb.slices.gi": "1",
        N + "mig-1g.10gb.slices.ci": "1",
        N + "mig-1g.10gb.engines.copy": "1",
        N + "mig-1g.10gb.engines.decoder": "1",
        N + "mig-1g.10gb.engines.encoder": "0",
        N + "mig-1g.10gb.engines.jpeg": "1",
        N + "mig-1g.10gb.engines.ofa": "0",
    }
    assert (ls[N + "mig-3g.40gb.memory"], ls[N + "mig-3g.40gb.multiprocessors"]) == ("40448", "60")
    # Under mixed, gpu.* still describe the physical GPUs, as in GFD's README example.
    assert (ls[N + "gpu.product"], ls[N + "gpu.count"], ls[N + "gpu.memory"]) == (
        "NVIDIA-H100-80GB-HBM3",
        "2",
        "81559",
    )


@pytest.mark.parametrize(
    ("gpu", "memory", "sms", "decoders", "jpeg"),
    [(A100, "9728", "14", "0", "0"), (H100, "9984", "16", "1", "1")],
    ids=["a100-80gb", "h100-80gb"],
)
def test_single_rewrites_the_gpu_labels_to_the_mig_devices(
    gpu: str, memory: str, sms: str, decoders: str, jpeg: str
) -> None:
    seven = "[1g.10gb, 1g.10gb, 1g.10gb, 1g.10gb, 1g.10gb, 1g.10gb, 1g.10gb]"
    text = f"gpus:\n  - {gpu}, count: 2, mig: {{enabled: true, instances: {seven}}}}}\n"
    ls = labels(text, "single")
    product = "NVIDIA-A100-SXM4-80GB" if "A100" in gpu else "NVIDIA-H100-80GB-HBM3"
    expected = {
        N + "gpu.product": f"{product}-MIG-1g.10gb",
        N + "gpu.count": "14",
        N + "gpu.memory": memory,
        N + "gpu.multiprocessors": sms,
        N + "gpu.slices.gi": "1",
        N + "gpu.slices.ci": "1",
        N + "gpu.engines.copy": "1",
        N + "gpu.engines.decoder": decoders,
        N + "gpu.engines.encoder": "0",
        N + "gpu.engines.jpeg": jpeg,
        N + "gpu.engines.ofa": "0",
        N + "mig.strategy": "single",
    }
    assert {k: ls.get(k) for k in expected} == expected
    assert ls[N + "gpu.family"] in ("ampere", "hopper")  # still the parent's


def test_single_with_two_profiles_is_invalid_as_gfd_says() -> None:
    ls = labels(A100_MIXED, "single")
    assert (ls[N + "gpu.product"], ls[N + "gpu.count"], ls[N + "gpu.memory"]) == (
        "NVIDIA-A100-SXM4-80GB-MIG-INVALID",
        "0",
        "0",
    )
    assert N + "gpu.multiprocessors" not in ls


def test_labels_change_only_when_the_layout_does() -> None:
    clock = FakeClock()
    text = A100_MIXED + "mig_changes: [{gpu: 1, after_s: 60, instances: [4g.40gb, 3g.40gb]}]\n"
    sim = SimulatedBackend(parse_profile(text), clock=clock)
    labeler, cache = NodeLabeler(N, mig_strategy="mixed"), Cache()
    cache.put_inventory(sim.inventory())
    first = labeler.build(cache.put_samples(sim.sample())).labels
    for _ in range(5):
        clock.t += 10
        assert labeler.build(cache.put_samples(sim.sample())).labels == first
    clock.t += 20
    cache.put_inventory(sim.inventory())
    after = labeler.build(cache.put_samples(sim.sample())).labels
    assert after[N + "mig-3g.40gb.count"] == "1" and after[N + "mig-4g.40gb.count"] == "1"


def test_the_annotation_lists_each_mig_device_and_who_holds_it() -> None:
    import json

    from gpudaemon.model import PodRef

    s = snap(A100_MIXED)
    assert s.inventory is not None
    held = s.inventory.gpus[1].mig_devices[0].uuid
    pods = {held: PodRef(pod="train-0", namespace="ml", container="main")}
    ls = NodeLabeler(N).build(s, pods)
    gpus = json.loads(ls.annotations[N + "gpus"])
    assert [e["mig_devices"] for e in gpus] == [7, 2]
    assert gpus[1]["mig"][0] == {
        "uuid": held, "profile": "3g.40gb", "gi": 1, "memory_total_mib": 40192, "pod": "ml/train-0",
    }  # fmt: skip
    assert gpus[1]["mig"][1]["pod"] == "" and gpus[0]["mig"][6]["profile"] == "1g.10gb"
    # Without the kubelet's answer nothing is claimed either way.
    unknown = json.loads(NodeLabeler(N).build(s).annotations[N + "gpus"])
    assert "pod" not in unknown[1]["mig"][0]
