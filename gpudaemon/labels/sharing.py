"""GPU sharing, as GPU Feature Discovery labels it when the device plugin shares no GPU
(no time-slicing or MPS configured, its default): `gpu.replicas` 1 for whole GPUs and
0 for GPUs in MIG mode (GFD labels them "without sharing"), `gpu.sharing-strategy`
`none`, `mps.capable` `false` (GFD k8s-device-plugin v0.19.3, internal/lm/resource.go
`baseLabeler`, `getReplicas`; internal/lm/nvml.go `newSharingLabeler`). The agent does
not read the device plugin's sharing config. Under GFD's own prefix (`nvidia.com/`)
GFD writes these keys from that config (time-slicing, MPS): the agent's Node sink
yields every key `is_sharing_key` names to whoever else set it (agent/nodesync.py), so
a cluster that shares GPUs keeps GFD's values (docs/migrate.md)."""

from __future__ import annotations

from gpudaemon.labels.base import RawLabels, primary_gpus
from gpudaemon.model import Snapshot

# The keys the device plugin's sharing configuration decides (GFD's `getReplicas`,
# `newSharingLabeler`), as suffixes of the prefix; `mig-<profile>.` ones too.
SHARING_KEYS = frozenset({"gpu.replicas", "gpu.sharing-strategy", "mps.capable"})
MIG_SHARING_SUFFIXES = (".replicas", ".sharing-strategy")


def is_sharing_key(key: str, prefix: str) -> bool:
    """True for a label the device plugin's sharing config owns under GFD's labels."""
    if not key.startswith(prefix):
        return False
    name = key[len(prefix) :]
    return name in SHARING_KEYS or (name.startswith("mig-") and name.endswith(MIG_SHARING_SUFFIXES))


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
