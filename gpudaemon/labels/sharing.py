"""GPU sharing, as GPU Feature Discovery labels it when the device plugin shares no GPU
(no time-slicing or MPS configured, its default): `gpu.replicas` 1 for whole GPUs and
0 for GPUs in MIG mode (GFD labels them "without sharing"), `gpu.sharing-strategy`
`none`, `mps.capable` `false` (GFD k8s-device-plugin v0.19.3, internal/lm/resource.go
`baseLabeler`, `getReplicas`; internal/lm/nvml.go `newSharingLabeler`). The agent does
not read the device plugin's sharing config: a cluster that shares GPUs keeps GFD for
these keys (docs/labels.md)."""

from __future__ import annotations

from gpudaemon.labels.base import RawLabels, primary_gpus
from gpudaemon.model import Snapshot


class SharingLabeler:
    def labels(self, snap: Snapshot) -> RawLabels:
        inv = snap.inventory
        if inv is None or not inv.gpus:
            return {}
        primary = primary_gpus(inv) or list(inv.gpus)
        # GFD's whole-GPU labeler overrides its MIG-mode one for the same model: 1 if
        # any GPU of the product the labels describe is a whole GPU.
        whole = any(not g.mig_enabled for g in primary)
        return {
            "gpu.replicas": 1 if whole else 0,
            "gpu.sharing-strategy": "none",
            "mps.capable": False,
        }
