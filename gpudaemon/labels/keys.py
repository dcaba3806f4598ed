"""The keys (after the prefix) that the agent writes and the extender, the rebalancer and
`gpudaemon status` read: one spelling for writers and readers alike, so a renamed label
cannot leave a reader looking for the old one."""

from __future__ import annotations

GPU_COUNT = "gpu.count"  # GPUs (or MIG devices under the single strategy) on the node
GPU_HEALTHY = "gpu.healthy"
GPU_UNHEALTHY = "gpu.unhealthy"  # physical GPUs; always present, 0 on a healthy node
GPU_PRODUCT = "gpu.product"
GPUS_ANNOTATION = "gpus"  # the per-GPU state annotation (labels/annotations.py)
