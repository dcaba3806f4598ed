"""GPU faults that outlive the agent: a critical XID or uncorrected ECC errors keep a
GPU unhealthy until the GPU is really reset, not merely until the agent restarts.

NVML reports an XID once, as an event, and a restarted agent would see a GPU that
fell off the bus as healthy. So each such fault is recorded with the kernel's boot ID
(kubelet reports the same ID as the Node's `nodeInfo.bootID`) and re-applied to the
GPU's samples after a restart while the boot ID is the same. A new boot ID (the node,
and so every GPU, was reset) clears the record. The record lives on the Node as the
annotation `<prefix>gpu-faults` when the agent writes to the API server, else in a
JSON file (`health.state_file`). docs/operations.md says how an operator clears it.

Failures to read or write the file never stop the agent: the fault is kept in memory
and one line is logged per episode.
"""

from __future__ import annotations

import json
import os
import stat
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from loguru import logger

from gpudaemon.backends.base import is_sticky
from gpudaemon.errors import UsageError
from gpudaemon.health import verdict
from gpudaemon.labels.annotations import bounded_json
from gpudaemon.logsetup import LogLimiter
from gpudaemon.model import GpuSample
from gpudaemon.textfile import MIB, read_text_file, write_atomic

DEFAULT_STATE_FILE = "/var/lib/gpudaemon/health.json"
MAX_RECORD_BYTES = 256 * 1024  # the API server's limit for all of a Node's annotations
_VERSION = 1
MAX_GPUS = 64
_MAX_RESETS = 16  # per GPU: far above any max_attempts


@dataclass(frozen=True)
class Fault:
    reason: str
    boot_id: str
    since: float  # UNIX seconds


class FaultStore(Protocol):
    """Where the record lives: `load` the last saved document (None: nothing saved),
    `save` a new one (OSError when it cannot be kept)."""

    where: str

    def load(self) -> object: ...

    def save(self, doc: dict[str, Any]) -> None: ...


class FileStore:
    """A JSON file on the node (outside Kubernetes, or `health.state_file` set)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.where = f"health.state_file {path}"

    def load(self) -> object:
        if not os.path.lexists(self.path):
            return None
        return bounded_json(read_text_file(self.path, "health.state_file", MIB), self.where, MIB)

    def save(self, doc: dict[str, Any]) -> None:
        _write_record(self.path, json.dumps(doc, indent=1).encode())


class AnnotationStore:
    """The record as the Node annotation `<prefix>gpu-faults`, read back at start-up.

    The chart's agent runs as non-root with no writable host directory, and a record
    on the Node object also survives the pod being deleted or moved. `load` returns
    what the Node held when the agent started (set by `seed`); `save` keeps the
    document for the next label reconcile, which writes it with the labels."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.where = f"Node annotation {key}"
        self.seeded = ""
        self.value: str = ""  # what the annotation should hold; "" removes it

    def seed(self, node: Mapping[str, Any]) -> None:
        raw = ((node.get("metadata") or {}).get("annotations") or {}).get(self.key)
        self.seeded = raw if isinstance(raw, str) and raw else ""
        self.value = self.seeded

    def load(self) -> object:
        # Parsed here, inside HealthMemory.load's error handling: a hand-edited
        # annotation is one error line, not a crash at start-up.
        # Bounded like every value read off a Node: a deep one is that line, not a
        # RecursionError at start-up.
        return bounded_json(self.seeded, self.key, MAX_RECORD_BYTES) if self.seeded else None

    def save(self, doc: dict[str, Any]) -> None:
        keep = doc["gpus"] or doc.get("resets")
        self.value = json.dumps(doc, separators=(",", ":"), sort_keys=True) if keep else ""


class HealthMemory:
    """Remembers sticky faults by GPU UUID; `apply` records new ones and re-applies old
    ones to a poll's samples. Called from the telemetry job only (one thread)."""

    def __init__(
        self,
        store: FaultStore,
        boot_id: str,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.boot_id = boot_id
        self.clock = clock
        self.faults: dict[str, Fault] = {}
        # UUID -> when each reset of the GPU ran (UNIX s): bounds resets per GPU per day
        # across restarts and boots (a reboot does not make a flaky GPU good).
        self.resets: dict[str, list[float]] = {}
        self._log = LogLimiter()
        # The telemetry job applies; a late read-back (the labels job) loads.
        self._lock = threading.RLock()
        self.load()

    def load(self) -> None:
        """Merge the store's record into memory (start-up, or once the Node is read)."""
        with self._lock:
            self._load()

    def _load(self) -> None:
        try:
            doc = self.store.load()
            if doc is None:
                return
            gpus = doc["gpus"] if isinstance(doc, dict) and doc.get("version") == _VERSION else None
            if not isinstance(gpus, dict):
                raise ValueError("not a gpudaemon health record (version 1)")
            assert isinstance(doc, dict)
            self._load_resets(doc.get("resets"))
            loaded: dict[str, Fault] = {}
            for uuid, f in gpus.items():
                fault = Fault(str(f["reason"]), str(f["boot_id"]), float(f["since"]))
                if fault.boot_id and fault.boot_id == self.boot_id:
                    loaded[str(uuid)] = fault
                else:
                    logger.info(
                        "GPU {}: {} recorded before a reset (boot ID changed): cleared",
                        uuid,
                        fault.reason,
                    )
        except (UsageError, ValueError, KeyError, TypeError, AttributeError, OverflowError) as e:
            logger.error(
                "{}: cannot read the GPU fault record ({}); starting without it",
                self.store.where,
                str(e).split("\n")[0],
            )
            return
        for uuid, f in sorted(loaded.items()):
            if uuid not in self.faults:
                self.faults[uuid] = f
                logger.warning(
                    "GPU {}: {} (recorded {}) stays unhealthy until the GPU or node is reset",
                    uuid,
                    f.reason,
                    time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(f.since)),
                )
        if len(loaded) != len(gpus):  # some were cleared by a reset: say so in the store
            self._save()

    def _load_resets(self, resets: object) -> None:
        """Merge the reset times read back (newest 16 per GPU, none from the future)."""
        if not isinstance(resets, dict):
            return
        now = self.clock()
        for uuid, times in list(resets.items())[:MAX_GPUS]:
            if not isinstance(uuid, str) or not isinstance(times, list):
                continue
            ok = [float(t) for t in times[-_MAX_RESETS:] if isinstance(t, int | float)
                  and not isinstance(t, bool) and 0 <= t <= now]  # fmt: skip
            merged = sorted(set(self.resets.get(uuid, [])) | set(ok))[-_MAX_RESETS:]
            if merged:
                self.resets[uuid] = merged

    def record_reset(self, uuid: str) -> None:
        """A reset of the GPU ran (whatever came of it); saved with the record."""
        with self._lock:
            times = self.resets.setdefault(uuid, [])
            times.append(round(self.clock(), 3))
            del times[:-_MAX_RESETS]
            self._save()

    def resets_within(self, uuid: str, seconds: float) -> int:
        with self._lock:
            since = self.clock() - seconds
            return sum(1 for t in self.resets.get(uuid, ()) if t >= since)

    def clear(self, uuid: str) -> bool:
        """Forget the GPU's sticky fault: a reset proved it gone. True if one was kept."""
        with self._lock:
            if self.faults.pop(uuid, None) is None:
                return False
            self._save()
            return True

    def apply(self, samples: Sequence[GpuSample]) -> tuple[GpuSample, ...]:
        with self._lock:
            return self._apply(samples)

    def _apply(self, samples: Sequence[GpuSample]) -> tuple[GpuSample, ...]:
        out: list[GpuSample] = []
        new = False
        for s in samples:
            known = self.faults.get(s.uuid) if s.uuid else None
            if not s.healthy and is_sticky(s.health_reason) and s.uuid and known is None:
                self.faults[s.uuid] = Fault(s.health_reason, self.boot_id, self.clock())
                new = True
            elif s.healthy and known is not None:
                s = verdict.apply(s, verdict.remembered(known.reason))
            out.append(s)
        if new:
            self._save()
        return tuple(out)

    def persist(self) -> None:
        """Write the record as it is now (after merging a late read-back)."""
        with self._lock:
            self._save()

    def _save(self) -> None:
        doc: dict[str, Any] = {
            "version": _VERSION,
            "gpus": {
                u: {"reason": f.reason, "boot_id": f.boot_id, "since": f.since}
                for u, f in sorted(self.faults.items())
            },
        }
        day_ago = self.clock() - 86400.0
        resets = {u: [t for t in ts if t >= day_ago] for u, ts in sorted(self.resets.items())}
        if any(resets.values()):  # older agents ignore the key
            doc["resets"] = {u: ts for u, ts in resets.items() if ts}
        try:
            self.store.save(doc)
        except OSError as e:
            if self._log.allow():
                logger.error(
                    "{}: cannot record a GPU fault ({}); it is kept in memory only and "
                    "would be forgotten on restart",
                    self.store.where,
                    e.strerror or e,
                )
            return
        if self._log.forget():
            logger.info("{}: GPU faults recorded again", self.store.where)


def _write_record(path: str, data: bytes) -> None:
    """Atomically, and never through a symlink or onto a non-file at `path` (a hostPath
    is shared with whatever else runs on the node)."""
    target = Path(path)
    try:
        st = os.lstat(target)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{path} is not a regular file")
    except FileNotFoundError:
        pass
    write_atomic(target, data, 0o600, fsync=True, dir_mode=0o700)
