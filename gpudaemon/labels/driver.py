"""Labels for the driver and the CUDA version it supports."""

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
            out["driver.major"] = parts[0]
            out["driver.minor"] = parts[1]
            if len(parts) >= 3:
                out["driver.rev"] = parts[2]
        if inv.cuda_driver_version is not None:
            out["cuda.driver.major"] = inv.cuda_driver_version[0]
            out["cuda.driver.minor"] = inv.cuda_driver_version[1]
        return out
