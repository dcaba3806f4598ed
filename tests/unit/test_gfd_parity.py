"""`labelPrefix: nvidia.com/` is a key-by-key drop-in for GPU Feature Discovery's labels
(issue 28): for MIG nodes under the single and mixed strategies, every key GFD writes is
written with GFD's value, and the keys we add beyond GFD's are exactly the documented
ones (docs/labels.md). Each row names the GFD source (k8s-device-plugin v0.19.3,
`internal/lm/`, read from the Go module proxy) that writes the key: the expected values
come from reading that code for this node, not from GFD's documentation."""

from __future__ import annotations

import pytest

from gpudaemon.agent.cache import Cache
from gpudaemon.backends.simulated import SimulatedBackend, parse_profile
from gpudaemon.labels import NodeLabeler
from gpudaemon.model import Snapshot

N = "nvidia.com/"
VERSION = "nvml.go newVersionLabeler"
MIG_CAPABLE = "nvml.go newMigCapabilityLabeler"
MPS = "nvml.go newSharingLabeler (no MPS configured)"
STRATEGY = "strategy.go migStrategyLabeler"
GPU_NO_SHARING = "mig-strategy.go newGPULabelers -> resource.go NewGPUResourceLabelerWithoutSharing"
GPU_ARCH = "resource.go newArchitectureLabels"
MIG_BASE = "resource.go NewMIGResourceLabeler -> baseLabeler"
MIG_ATTR = "resource.go newMigAttributeLabels (internal/resource/nvml-mig-device.go GetAttributes)"
INVALID = "mig-strategy.go newInvalidMigStrategyLabeler"

# Keys we write that GFD does not (docs/labels.md, "Beyond GFD's keys").
EXTRAS = {"gpu.present", "gpu.memory.min", "gpu.healthy", "gpu.unhealthy", "mig.enabled"}

A100 = "{name: NVIDIA A100-SXM4-80GB, memory_total_mib: 81920, compute_capability: '8.0'"
SEVEN = "[1g.10gb, 1g.10gb, 1g.10gb, 1g.10gb, 1g.10gb, 1g.10gb, 1g.10gb]"
HEAD = 'driver_version: "535.161.08"\ncuda_version: "12.2"\ngpus:\n'
# GPU 0 as 7x 1g.10gb, GPU 1 as 2x 3g.40gb + 1x 1g.10gb+me.
TWO_LAYOUTS = (
    HEAD + f"  - {A100}, mig: {{enabled: true, instances: {SEVEN}}}}}\n"
    f"  - {A100}, mig: {{enabled: true, instances: [3g.40gb, 3g.40gb]}}}}\n"
)
ONE_LAYOUT = HEAD + f"  - {A100}, count: 2, mig: {{enabled: true, instances: {SEVEN}}}}}\n"

COMMON = [
    ("cuda.driver.major", "535", VERSION),
    ("cuda.driver.minor", "161", VERSION),
    ("cuda.driver.rev", "08", VERSION),
    ("cuda.driver-version.major", "535", VERSION),
    ("cuda.driver-version.minor", "161", VERSION),
    ("cuda.driver-version.revision", "08", VERSION),
    ("cuda.driver-version.full", "535.161.08", VERSION),
    ("cuda.runtime.major", "12", VERSION),
    ("cuda.runtime.minor", "2", VERSION),
    ("cuda.runtime-version.major", "12", VERSION),
    ("cuda.runtime-version.minor", "2", VERSION),
    ("cuda.runtime-version.full", "12.2", VERSION),
    ("mig.capable", "true", MIG_CAPABLE),
    ("mps.capable", "false", MPS),
    ("gpu.family", "ampere", GPU_ARCH),
    ("gpu.compute.major", "8", GPU_ARCH),
    ("gpu.compute.minor", "0", GPU_ARCH),
]


def mig_rows(
    profile: str, product: str, count: int, attrs: tuple[int, ...]
) -> list[tuple[str, str, str]]:
    names = ("memory", "multiprocessors", "slices.gi", "slices.ci", "engines.copy",
             "engines.decoder", "engines.encoder", "engines.jpeg", "engines.ofa")  # fmt: skip
    return [
        (f"{profile}.product", f"{product}-MIG-{profile.split('-', 1)[1]}", MIG_BASE),
        (f"{profile}.count", str(count), MIG_BASE),
        (f"{profile}.replicas", "1", MIG_BASE),
        (f"{profile}.sharing-strategy", "none", MIG_BASE),
    ] + [(f"{profile}.{n}", str(v), MIG_ATTR) for n, v in zip(names, attrs, strict=True)]


A100_NAME = "NVIDIA-A100-SXM4-80GB"
A100_1G10 = (9728, 14, 1, 1, 1, 0, 0, 0, 0)  # nvidia-smi mig -lgip, A100-SXM4-80GB

CASES: dict[str, tuple[str, str, list[tuple[str, str, str]]]] = {
    "mixed": (
        TWO_LAYOUTS,
        "mixed",
        [
            *COMMON,
            ("mig.strategy", "mixed", STRATEGY),
            # Under mixed, gpu.* are the physical GPUs, in MIG mode: "without sharing".
            ("gpu.product", A100_NAME, GPU_NO_SHARING),
            ("gpu.count", "2", GPU_NO_SHARING),
            ("gpu.replicas", "0", GPU_NO_SHARING),
            ("gpu.sharing-strategy", "none", GPU_NO_SHARING),
            ("gpu.memory", "81920", GPU_NO_SHARING),
            *mig_rows("mig-1g.10gb", A100_NAME, 7, A100_1G10),
            *mig_rows("mig-3g.40gb", A100_NAME, 2, (40192, 42, 3, 3, 3, 2, 0, 0, 0)),
        ],
    ),
    "single": (
        ONE_LAYOUT,
        "single",
        [
            *COMMON,
            ("mig.strategy", "single", STRATEGY),
            *[
                ("gpu" + k[len("mig-1g.10gb") :], v, src)
                for k, v, src in mig_rows("mig-1g.10gb", A100_NAME, 14, A100_1G10)
            ],
        ],
    ),
    "single-invalid": (
        TWO_LAYOUTS,
        "single",
        [
            *COMMON,
            ("mig.strategy", "single", STRATEGY),
            ("gpu.product", f"{A100_NAME}-MIG-INVALID", INVALID),
            ("gpu.count", "0", INVALID),
            ("gpu.replicas", "0", INVALID),
            ("gpu.sharing-strategy", "", INVALID),
            ("gpu.memory", "0", INVALID),
        ],
    ),
}


def snap(text: str) -> Snapshot:
    sim = SimulatedBackend(parse_profile(text))
    cache = Cache()
    cache.put_inventory(sim.inventory())
    return cache.put_samples(sim.sample())


def labels(text: str, strategy: str) -> dict[str, str]:
    return dict(NodeLabeler(N, mig_strategy=strategy).build(snap(text)).labels)


@pytest.mark.parametrize(
    ("case", "key", "value", "source"),
    [(c, k, v, s) for c, (_, _, rows) in CASES.items() for k, v, s in rows],
    ids=lambda x: x if isinstance(x, str) and len(x) < 40 else "",
)
def test_every_gfd_key_has_gfds_value(case: str, key: str, value: str, source: str) -> None:
    text, strategy, _ = CASES[case]
    assert labels(text, strategy).get(N + key) == value, f"{key}: GFD's {source}"


@pytest.mark.parametrize("case", list(CASES))
def test_beyond_gfds_keys_we_write_only_the_documented_extras(case: str) -> None:
    text, strategy, rows = CASES[case]
    ours = {k.removeprefix(N) for k in labels(text, strategy)}
    assert ours - {k for k, _, _ in rows} == EXTRAS
    # Single: GFD's MIG labeler writes no attribute labels for an invalid layout.
    if case == "single-invalid":
        assert "gpu.multiprocessors" not in ours


def test_a_media_extension_profile_is_named_as_the_device_plugin_names_it() -> None:
    """`1g.10gb+me` is the resource `nvidia.com/mig-1g.10gb.me` (GetName replaces `+`)."""
    text = HEAD + f"  - {A100}, mig: {{enabled: true, instances: [1g.10gb+me, 3g.40gb]}}}}\n"
    ls = labels(text, "mixed")
    assert ls[N + "mig-1g.10gb.me.product"] == f"{A100_NAME}-MIG-1g.10gb.me"
    assert ls[N + "mig-1g.10gb.me.count"] == "1"
    assert ls[N + "mig-1g.10gb.me.engines.ofa"] == "1"
    one = HEAD + f"  - {A100}, mig: {{enabled: true, instances: [1g.10gb+me]}}}}\n"
    assert labels(one, "single")[N + "gpu.product"] == f"{A100_NAME}-MIG-1g.10gb.me"


def test_single_with_a_mig_gpu_that_has_no_devices_is_invalid_as_in_gfd() -> None:
    """`AnyMigEnabledDeviceIsEmpty`: one empty MIG GPU makes the whole layout invalid."""
    text = (
        HEAD + f"  - {A100}, mig: {{enabled: true, instances: {SEVEN}}}}}\n"
        f"  - {A100}, mig: {{enabled: true, instances: []}}}}\n"
    )
    assert labels(text, "single")[N + "gpu.product"] == f"{A100_NAME}-MIG-INVALID"
    # Mixed ignores the empty GPU, as GFD's newMigStrategyMixedLabeler does.
    assert labels(text, "mixed")[N + "mig-1g.10gb.count"] == "7"


def test_whole_gpus_have_one_replica_and_no_sharing() -> None:
    text = HEAD + f"  - {A100}, count: 2}}\n"
    ls = labels(text, "none")
    assert (ls[N + "gpu.replicas"], ls[N + "gpu.sharing-strategy"]) == ("1", "none")
