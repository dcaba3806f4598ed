"""MIG labels, with GPU Feature Discovery's keys, values and units: whether the GPUs
can be partitioned and are, the strategy, and what the MIG devices are.

- mixed: each profile is its own resource `nvidia.com/mig-<profile>`, described by
  `mig-<profile>.count`, `.memory` (MiB), `.multiprocessors`, `.slices.gi`,
  `.slices.ci` and `.engines.{copy,decoder,encoder,jpeg,ofa}`;
- single: every MIG device is an `nvidia.com/gpu`, so `gpu.count`, `gpu.memory`,
  `gpu.product` (`<product>-MIG-<profile>`), `gpu.multiprocessors`, `gpu.slices.*` and
  `gpu.engines.*` describe them, replacing the whole-GPU values (this labeler runs
  after the inventory's); GPUs that disagree make the product `<product>-MIG-INVALID`.

Values change only when the layout does: nothing here depends on a sample.
"""

from __future__ import annotations

from collections import Counter

from gpudaemon.labels.base import RawLabels, primary_gpus
from gpudaemon.model import MigDevice, Snapshot

STRATEGIES = ("none", "single", "mixed")


def resource_suffix(profile: str) -> str:
    """`mig-<profile>`, as the device plugin names the resource (`+me` becomes `.me`:
    a resource name cannot hold a `+`)."""
    return "mig-" + profile.replace("+", ".")


def attribute_labels(m: MigDevice) -> dict[str, int]:
    """GFD's per-MIG-device attributes, under the names it gives them (absent: unread)."""
    values = {
        "memory": m.memory_total_mib,
        "multiprocessors": m.multiprocessors,
        "slices.gi": m.gpu_instance_slices,
        "slices.ci": m.compute_instance_slices,
        "engines.copy": m.copy_engines,
        "engines.decoder": m.decoders,
        "engines.encoder": m.encoders,
        "engines.jpeg": m.jpeg_engines,
        "engines.ofa": m.ofa_engines,
    }
    return {k: v for k, v in values.items() if v is not None}


class MigLabeler:
    def __init__(self, strategy: str = "none") -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown MIG strategy {strategy!r}")
        self.strategy = strategy

    def labels(self, snap: Snapshot) -> RawLabels:
        inv = snap.inventory
        if inv is None or not inv.gpus:
            return {}
        out: dict[str, str | int | bool] = {
            "mig.capable": any(g.mig_capable for g in inv.gpus),
            "mig.enabled": any(g.mig_enabled for g in inv.gpus),
            "mig.strategy": self.strategy,
        }
        if self.strategy == "mixed":
            out.update(self._mixed(snap))
        elif self.strategy == "single":
            out.update(self._single(snap))
        return out

    def _mixed(self, snap: Snapshot) -> RawLabels:
        assert snap.inventory is not None
        devices = [m for g in snap.inventory.gpus if g.mig_enabled for m in g.mig_devices]
        counts = Counter(m.profile for m in devices)
        out: dict[str, str | int | bool] = {}
        for m in devices:  # the first device of each profile describes it, as in GFD
            key = resource_suffix(m.profile)
            if f"{key}.count" in out:
                continue
            out[f"{key}.count"] = counts[m.profile]
            out.update({f"{key}.{k}": v for k, v in attribute_labels(m).items()})
        return out

    def _single(self, snap: Snapshot) -> RawLabels:
        inv = snap.inventory
        assert inv is not None
        enabled = [g for g in inv.gpus if g.mig_enabled]
        if not enabled:
            return {}  # no MIG: the whole-GPU labels stand, as GFD falls back to them
        primary = primary_gpus(inv)
        product = (primary[0] if primary else inv.gpus[0]).name
        devices = [m for g in enabled for m in g.mig_devices]
        profiles = {m.profile for m in devices}
        if len(enabled) != len(inv.gpus) or len(profiles) != 1:
            # Some GPUs not in MIG mode, none with devices, or two profiles: the device
            # plugin cannot advertise one nvidia.com/gpu, and GFD says so.
            return {
                "gpu.product": f"{product}-MIG-INVALID",
                "gpu.count": 0,
                "gpu.memory": 0,
            }
        first = devices[0]
        out: dict[str, str | int | bool] = {
            "gpu.product": f"{product}-MIG-{first.profile}",
            "gpu.count": len(devices),
        }
        out.update({f"gpu.{k}": v for k, v in attribute_labels(first).items()})
        return out
