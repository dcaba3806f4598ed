"""Labels for the driver and the CUDA version it supports, with GPU Feature Discovery's
keys and meanings, so `labelPrefix: nvidia.com/` is a drop-in: `cuda.driver.*` is the
driver version (550/54/15) and `cuda.runtime.*` the CUDA version it supports (12/4),
with the newer spellings beside them (`cuda.driver-version.{major,minor,revision,full}`,
`cuda.runtime-version.{major,minor,full}`; GFD v0.19.3 internal/lm/nvml.go
`newVersionLabeler`)."""

from __future__ import annotations

from gpudaemon.labels.base import RawLabels
from gpudaemon.model import Snapshot


class DriverLabeler:
    def labels(self, snap: Snapshot) -> RawLabels:
        inv = snap.inventory
        if inv is None or not inv.gpus:
            return {}
        out: dict[str, str | int | bool] = {}
        full = inv.driver_version
        parts = full.split(".")
        if 2 <= len(parts) <= 3 and parts[0].isdigit():
            # GFD: "X.Y[.Z]", the revision as written ("08" stays "08"), "" when absent.
            rev = parts[2] if len(parts) == 3 else ""
            out["cuda.driver.major"] = out["cuda.driver-version.major"] = parts[0]
            out["cuda.driver.minor"] = out["cuda.driver-version.minor"] = parts[1]
            out["cuda.driver.rev"] = out["cuda.driver-version.revision"] = rev
            out["cuda.driver-version.full"] = full
        if inv.cuda_driver_version is not None:
            major, minor = inv.cuda_driver_version
            out["cuda.runtime.major"] = out["cuda.runtime-version.major"] = major
            out["cuda.runtime.minor"] = out["cuda.runtime-version.minor"] = minor
            out["cuda.runtime-version.full"] = f"{major}.{minor}"
        return out
