"""MIG labels, with GPU Feature Discovery's keys, values and units: whether the GPUs
can be partitioned and are, the strategy, and what the MIG devices are. Checked key by
key against GFD's source (k8s-device-plugin v0.19.3, internal/lm/mig-strategy.go and
resource.go; tests/unit/test_mig_labels.py cites the function per key).

- mixed: each profile is its own resource `nvidia.com/mig-<profile>`, described by
  `mig-<profile>.product` (`<product>-MIG-<profile>`), `.count`, `.replicas` (1),
  `.sharing-strategy` (`none`), `.memory` (MiB), `.multiprocessors`, `.slices.gi`,
  `.slices.ci` and `.engines.{copy,decoder,encoder,jpeg,ofa}`;
- single: every MIG device is an `nvidia.com/gpu`, so `gpu.product`
  (`<product>-MIG-<profile>`), `gpu.count`, `gpu.replicas`, `gpu.sharing-strategy`,
  `gpu.memory`, `gpu.multiprocessors`, `gpu.slices.*` and `gpu.engines.*` describe
  them, replacing the whole-GPU values (this labeler runs after the inventory's and the
  sharing labeler's); a layout the device plugin cannot serve as one resource (GPUs
  in and out of MIG mode, a MIG GPU with no devices, two profiles) is
  `<product>-MIG-INVALID` with count, replicas and memory 0 and an empty strategy.

Values change only when the layout does: nothing here depends on a sample.
"""

from __future__ import annotations

from collections import Counter

from gpudaemon.labels.base import RawLabels, primary_gpus
from gpudaemon.labels.keys import GPU_COUNT, GPU_PRODUCT
from gpudaemon.model import MigDevice, Snapshot

STRATEGIES = ("none", "single", "mixed")


def profile_name(profile: str) -> str:
    """The profile as GFD names it (`+me` becomes `.me`: a resource name cannot hold a
    `+`; internal/resource/nvml-mig-device.go `GetName`)."""
    return profile.replace("+", ".")


def resource_suffix(profile: str) -> str:
    """`mig-<profile>`, as the device plugin names the resource."""
    return "mig-" + profile_name(profile)


def base_labels(product: str, profile: str, count: int) -> dict[str, str | int | bool]:
    """GFD's `baseLabeler` for a MIG resource, with no sharing configured: product
    `<product>-MIG-<profile>`, count, one replica, strategy `none`."""
    return {
        "product": f"{product}-MIG-{profile_name(profile)}",
        "count": count,
        "replicas": 1,
        "sharing-strategy": "none",
    }


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
        devices = [(g, m) for g in snap.inventory.gpus if g.mig_enabled for m in g.mig_devices]
        counts = Counter(profile_name(m.profile) for _, m in devices)
        out: dict[str, str | int | bool] = {}
        for g, m in devices:  # the first device of each profile describes it, as in GFD
            key = resource_suffix(m.profile)
            if f"{key}.count" in out:
                continue
            base = base_labels(g.name, m.profile, counts[profile_name(m.profile)])
            out.update({f"{key}.{k}": v for k, v in base.items()})
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
        profiles = {profile_name(m.profile) for m in devices}
        empty = any(not g.mig_devices for g in enabled)
        if empty or len(enabled) != len(inv.gpus) or len(profiles) != 1:
            # A MIG GPU with no devices, GPUs in and out of MIG mode, or two profiles:
            # the device plugin cannot advertise one nvidia.com/gpu, and GFD says so
            # (`newInvalidMigStrategyLabeler`).
            return {
                GPU_PRODUCT: f"{product}-MIG-INVALID",
                GPU_COUNT: 0,
                "gpu.replicas": 0,
                "gpu.sharing-strategy": "",
                "gpu.memory": 0,
            }
        first = devices[0]
        out = {f"gpu.{k}": v for k, v in base_labels(product, first.profile, len(devices)).items()}
        out.update({f"gpu.{k}": v for k, v in attribute_labels(first).items()})
        return out
