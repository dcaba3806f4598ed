"""A bounded, durable, in-order spool of InfluxDB line protocol on local disk.

influxdb-client keeps its retry buffer in memory, so an outage that outlives the
process would lose points. The spool is a directory of append-only segment files
(`seg-<20-digit number>.lp`, one line per point, fsync'd on every append) that the
writer drains oldest first. A segment is removed only after InfluxDB accepted it,
so a crash in between replays it once more, which is harmless because a point with
the same measurement, tags and timestamp overwrites itself.

When the spool outgrows its byte bound, whole segments are dropped oldest first and
the points in them are reported to the caller, who counts and logs them.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from gpudaemon.errors import SpoolError, SpoolLockedError

_SEGMENT = re.compile(r"^seg-(\d{20})\.lp$")
_PROBE = ".probe"


def _error(path: Path, e: OSError) -> SpoolError:
    reason = e.strerror or str(e)
    return SpoolError(f"spool {path}: {reason}", reason)


@dataclass
class Segment:
    path: Path
    number: int
    size_bytes: int
    points: int


class Spool:
    """Not thread-safe; the InfluxDB writer serialises calls under its own lock."""

    def __init__(self, directory: str | Path, max_bytes: int, segment_bytes: int | None = None):
        self.dir = Path(directory)
        self.max_bytes = max_bytes
        # Small enough that an overflow drops little more than it must, big enough that
        # replay sends few requests: 1/16 of the bound, between 4 KiB and 1 MiB.
        self.segment_bytes = segment_bytes or min(1 << 20, max(4096, max_bytes // 16))
        self._segments: deque[Segment] = deque()
        self._lock_fd: int | None = None
        try:
            if self.dir.exists() and not self.dir.is_dir():  # mkdir would say "File exists"
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
            self.dir.mkdir(parents=True, exist_ok=True)
            self._lock_fd = os.open(self.dir / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self._load()
        except BlockingIOError:
            self._close_lock()
            raise SpoolLockedError(
                f"spool {self.dir} is in use by another process", "in use by another process"
            ) from None
        except OSError as e:
            self._close_lock()
            raise _error(self.dir, e) from None
        except SpoolError:
            self._close_lock()
            raise

    # -- state -------------------------------------------------------------------

    @property
    def points(self) -> int:
        return sum(s.points for s in self._segments)

    @property
    def size_bytes(self) -> int:
        return sum(s.size_bytes for s in self._segments)

    def __len__(self) -> int:
        return len(self._segments)

    def _load(self) -> None:
        """Pick up what an earlier run left, repairing a torn last line after a crash."""
        found: list[Segment] = []
        for p in self.dir.iterdir():
            m = _SEGMENT.match(p.name)
            if not m:
                continue
            try:
                data = p.read_bytes()
            except OSError as e:
                raise _error(p, e) from None
            if data and not data.endswith(b"\n"):
                data = data[: data.rfind(b"\n") + 1]
                with open(p, "r+b") as f:
                    f.truncate(len(data))
                    os.fsync(f.fileno())
            if not data:
                p.unlink(missing_ok=True)
                continue
            found.append(Segment(p, int(m.group(1)), len(data), data.count(b"\n")))
        self._segments = deque(sorted(found, key=lambda s: s.number))

    # -- writing -----------------------------------------------------------------

    def append(self, lines: list[str]) -> int:
        """Append points durably (fsync). Returns how many old points the bound dropped."""
        if not lines:
            return 0
        data = "".join(line + "\n" for line in lines).encode()
        seg = self._segments[-1] if self._segments else None
        if seg is None or seg.size_bytes >= self.segment_bytes:
            seg = Segment(self._next_path(), self._next_number(), 0, 0)
            new = True
        else:
            new = False
        try:
            fd = os.open(seg.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                try:
                    os.write(fd, data)
                    os.fsync(fd)
                except OSError:
                    os.ftruncate(fd, seg.size_bytes)  # no half-written batch (disk full)
                    raise
            finally:
                os.close(fd)
            if new:
                self._fsync_dir()
        except OSError as e:
            raise _error(seg.path, e) from None
        if new:
            self._segments.append(seg)
        seg.size_bytes += len(data)
        seg.points += len(lines)
        return self._enforce_bound()

    def _enforce_bound(self) -> int:
        dropped = 0
        while self._segments and self.size_bytes > self.max_bytes:
            seg = self._segments.popleft()
            dropped += seg.points
            # Forgotten either way; a file that will not go is met again after a restart.
            with contextlib.suppress(OSError):
                seg.path.unlink(missing_ok=True)
        return dropped

    def _next_number(self) -> int:
        return self._segments[-1].number + 1 if self._segments else 1

    def _next_path(self) -> Path:
        return self.dir / f"seg-{self._next_number():020d}.lp"

    # -- reading -----------------------------------------------------------------

    def oldest(self) -> Segment | None:
        return self._segments[0] if self._segments else None

    def read(self, seg: Segment) -> bytes:
        try:
            return seg.path.read_bytes()
        except OSError as e:
            raise _error(seg.path, e) from None

    def remove(self, seg: Segment) -> None:
        """Forget a segment InfluxDB accepted (or rejected for good)."""
        if self._segments and self._segments[0] is seg:
            self._segments.popleft()
        else:
            self._segments.remove(seg)
        self._unlink(seg)

    def _unlink(self, seg: Segment) -> None:
        try:
            seg.path.unlink(missing_ok=True)
        except OSError as e:
            raise _error(seg.path, e) from None

    def _fsync_dir(self) -> None:
        fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def probe(self) -> None:
        """Check that the directory takes a durable write again (after a disk-full or
        I/O error), without touching the segments."""
        path = self.dir / _PROBE
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, b"\n")
                os.fsync(fd)
            finally:
                os.close(fd)
            path.unlink()
        except OSError as e:
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
            raise _error(path, e) from None

    # -- lifecycle ---------------------------------------------------------------

    def _close_lock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def close(self) -> None:
        self._close_lock()
