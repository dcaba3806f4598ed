"""GPU Feature Discovery's labels, the one fixture the tests compare ours with
(`labelPrefix: nvidia.com/` is a key-by-key drop-in for GFD: docs/migrate.md).

GFD_DGX_H100 is what GFD (k8s-device-plugin v0.19.3, `internal/lm/`) writes for the
`dgx-h100` simulation profile: eight H100 80GB HBM3 on driver 550.54.15 with CUDA 12.4,
MIG strategy none. The sources: nvml.go newVersionLabeler (cuda.*: `cuda.driver.*` is the
driver version and `cuda.runtime.*` the CUDA version, as GFD means them, plus the newer
`*-version.*` spellings), newMigCapabilityLabeler (mig.capable), newSharingLabeler
(mps.capable, no MPS configured), strategy.go migStrategyLabeler (mig.strategy),
resource.go NewGPUResourceLabelerWithoutSharing (gpu.product with spaces as dashes,
gpu.count, gpu.memory in MiB, gpu.replicas, gpu.sharing-strategy) and
newArchitectureLabels (gpu.family from the compute capability, gpu.compute.*).
tests/unit/test_gfd_parity.py holds the MIG cases, with a source per row.
"""

from __future__ import annotations

N = "nvidia.com/"

GFD_DGX_H100 = {
    N + k: v
    for k, v in {
        "gpu.product": "NVIDIA-H100-80GB-HBM3",
        "gpu.count": "8",
        "gpu.memory": "81559",
        "gpu.replicas": "1",
        "gpu.sharing-strategy": "none",
        "gpu.family": "hopper",
        "gpu.compute.major": "9",
        "gpu.compute.minor": "0",
        "cuda.driver.major": "550",
        "cuda.driver.minor": "54",
        "cuda.driver.rev": "15",
        "cuda.runtime.major": "12",
        "cuda.runtime.minor": "4",
        "cuda.driver-version.full": "550.54.15",
        "cuda.driver-version.major": "550",
        "cuda.driver-version.minor": "54",
        "cuda.driver-version.revision": "15",
        "cuda.runtime-version.full": "12.4",
        "cuda.runtime-version.major": "12",
        "cuda.runtime-version.minor": "4",
        "mig.capable": "true",
        "mig.strategy": "none",
        "mps.capable": "false",
    }.items()
}

# Keys we write that GFD does not (docs/labels.md, "Beyond GFD's keys"), without prefix.
BEYOND_GFD = {"gpu.present", "gpu.memory.min", "gpu.healthy", "gpu.unhealthy", "mig.enabled"}
