"""Labels for what GPUs the node has: presence, count, product, family, memory, compute."""

from __future__ import annotations

from gpudaemon.labels.base import RawLabels, primary_gpus
from gpudaemon.labels.keys import GPU_COUNT, GPU_PRODUCT
from gpudaemon.model import Snapshot

# Compute capability major (and minor where it matters) -> architecture family,
# spelled the way GPU Feature Discovery spells it.
_FAMILIES: dict[tuple[int, int | None], str] = {
    (3, None): "kepler",
    (5, None): "maxwell",
    (6, None): "pascal",
    (7, 0): "volta",
    (7, 2): "volta",
    (7, 5): "turing",
    (8, 9): "ada-lovelace",
    (8, None): "ampere",
    (9, None): "hopper",
    (10, None): "blackwell",
    (12, None): "blackwell",
}


def family(major: int, minor: int) -> str:
    return _FAMILIES.get((major, minor)) or _FAMILIES.get((major, None)) or "undefined"


class InventoryLabeler:
    def labels(self, snap: Snapshot) -> RawLabels:
        inv = snap.inventory
        if inv is None:
            return {}
        out: dict[str, str | int | bool] = {
            "gpu.present": bool(inv.gpus),
            GPU_COUNT: len(inv.gpus),
        }
        primary = primary_gpus(inv)
        if primary:
            g = primary[0]
            major, minor = g.compute_capability
            out |= {
                GPU_PRODUCT: g.name,
                "gpu.family": family(major, minor),
                "gpu.memory": min(p.memory_total_mib for p in primary),
                # Every GPU has at least this much: what `Gt` means on a mixed node.
                "gpu.memory.min": min(
                    (x.memory_total_mib for x in inv.gpus if x.memory_total_mib > 0),
                    default=min(p.memory_total_mib for p in primary),
                ),
                "gpu.compute.major": major,
                "gpu.compute.minor": minor,
            }
            if len({x.name for x in inv.gpus if x.name != "unknown"}) > 1:
                out["gpu.mixed"] = True
        return out
