"""GPU faults that outlive the agent: a critical XID or uncorrected ECC errors keep a
GPU unhealthy until the GPU is really reset, not merely until the agent restarts.

NVML reports an XID once, as an event, and a restarted agent would see a GPU that
fell off the bus as healthy. So each such fault is written to a small JSON file on the
node (`health.state_file`, a hostPath in the chart) with the kernel's boot ID, and
re-applied to the GPU's samples after a restart while the boot ID is the same. A new
boot ID (the node, and so every GPU, was reset) clears the record. An operator clears
it after a repair by deleting the file (docs/operations.md).

Failures to read or write the file never stop the agent: the fault is kept in memory
and one line is logged per episode.
"""

from __future__ import annotations

import json
import os
import stat
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from loguru import logger

from gpudaemon.backends.base import is_sticky
from gpudaemon.errors import UsageError
from gpudaemon.logsetup import LogLimiter
from gpudaemon.model import GpuSample
from gpudaemon.textfile import MIB, read_text_file

DEFAULT_STATE_FILE = "/var/lib/gpudaemon/health.json"
_VERSION = 1


@dataclass(frozen=True)
class Fault:
    reason: str
    boot_id: str
    since: float  # UNIX seconds


class HealthMemory:
    """Remembers sticky faults by GPU UUID; `apply` records new ones and re-applies old
    ones to a poll's samples. Called from the telemetry job only (one thread)."""

    def __init__(
        self,
        path: str,
        boot_id: str,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = path
        self.boot_id = boot_id
        self.clock = clock
        self.faults: dict[str, Fault] = {}
        self._log = LogLimiter()
        self._load()

    def _load(self) -> None:
        if not self.path or not os.path.lexists(self.path):
            return
        try:
            doc = json.loads(read_text_file(self.path, "health.state_file", MIB))
            gpus = doc["gpus"] if isinstance(doc, dict) and doc.get("version") == _VERSION else None
            if not isinstance(gpus, dict):
                raise ValueError("not a gpudaemon health record (version 1)")
            for uuid, f in gpus.items():
                fault = Fault(str(f["reason"]), str(f["boot_id"]), float(f["since"]))
                if fault.boot_id and fault.boot_id == self.boot_id:
                    self.faults[str(uuid)] = fault
                else:
                    logger.info(
                        "GPU {}: {} recorded before a reset (boot ID changed): cleared",
                        uuid,
                        fault.reason,
                    )
        except (UsageError, ValueError, KeyError, TypeError) as e:
            logger.error(
                "health.state_file {}: cannot read the GPU fault record ({}); starting without it",
                self.path,
                str(e).split("\n")[0],
            )
            return
        for uuid, f in sorted(self.faults.items()):
            logger.warning(
                "GPU {}: {} (recorded {}) stays unhealthy until the GPU or node is reset",
                uuid,
                f.reason,
                time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(f.since)),
            )

    def apply(self, samples: Sequence[GpuSample]) -> tuple[GpuSample, ...]:
        out: list[GpuSample] = []
        new = False
        for s in samples:
            known = self.faults.get(s.uuid) if s.uuid else None
            if not s.healthy and is_sticky(s.health_reason) and s.uuid and known is None:
                self.faults[s.uuid] = Fault(s.health_reason, self.boot_id, self.clock())
                new = True
            elif s.healthy and known is not None:
                s = replace(s, healthy=False, health_reason=known.reason)
            out.append(s)
        if new:
            self._save()
        return tuple(out)

    def _save(self) -> None:
        if not self.path:
            return
        doc = {
            "version": _VERSION,
            "gpus": {
                u: {"reason": f.reason, "boot_id": f.boot_id, "since": f.since}
                for u, f in sorted(self.faults.items())
            },
        }
        try:
            _write_atomic(self.path, json.dumps(doc, indent=1).encode())
        except OSError as e:
            if self._log.allow():
                logger.error(
                    "health.state_file {}: cannot record a GPU fault ({}); it is kept in "
                    "memory only and would be forgotten on restart",
                    self.path,
                    e.strerror or e,
                )
            return
        if self._log.forget():
            logger.info("health.state_file {}: GPU faults recorded again", self.path)


def _write_atomic(path: str, data: bytes) -> None:
    """Write a sibling temp file and rename it over `path`: a crash leaves the old
    record or the new one, never half of one. A symlink or non-file at `path` is
    refused (a hostPath is shared with whatever else runs on the node)."""
    target = Path(path)
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        st = os.lstat(target)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{path} is not a regular file")
    except FileNotFoundError:
        pass
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, target)
