"""Labels for the driver and the CUDA version it supports, with GPU Feature Discovery's
keys and meanings, so `labelPrefix: nvidia.com/` is a drop-in: `cuda.driver.*` is the
driver version (550/54/15) and `cuda.runtime.*` the CUDA version it supports (12/4)."""

from __future__ import annotations

from gpudaemon.labels.base import RawLabels
from gpudaemon.model import Snapshot


class DriverLabeler:
    def labels(self, snap: Snapshot) -> RawLabels:
        inv = snap.inventory
        if inv is None or not inv.gpus:
            return {}
        out: dict[str, str | int | bool] = {}
        parts = inv.driver_version.split(".")
        if len(parts) >= 2 and parts[0].isdigit():
            out["cuda.driver.major"] = parts[0]
            out["cuda.driver.minor"] = parts[1]
            if len(parts) >= 3:
                out["cuda.driver.rev"] = parts[2]  # as written: "08" stays "08", as in GFD
        if inv.cuda_driver_version is not None:
            out["cuda.runtime.major"] = inv.cuda_driver_version[0]
            out["cuda.runtime.minor"] = inv.cuda_driver_version[1]
        return out
