"""A bounded, durable, in-order spool of InfluxDB line protocol in one SQLite file.

influxdb-client keeps its retry buffer in memory, so an outage that outlives the
process would lose points. The spool is `spool.db` (stdlib sqlite3, WAL, synchronous
FULL): one row per point, one transaction per batch, so a write is either committed
whole or rolled back, also on a full disk, and no torn or padded line can exist. The
writer reads the oldest rows, sends them, then deletes them (`ack`).

Only the spool's own regular files are ever opened (history/ownfile.py); anything
else in the directory is reported and left alone.

When the spool would outgrow its byte bound (the line-protocol bytes it holds), whole
batches are dropped oldest first, in the same transaction as the append, and the
count is reported to the caller.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import math
import os
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from gpudaemon.errors import SpoolError, SpoolLockedError
from gpudaemon.history.linecheck import plausible_line
from gpudaemon.history.ownfile import check_own_file, open_own, spool_error

DB_NAME = "spool.db"
LOCK_NAME = ".lock"
# SQLite's companions of DB_NAME; checked like it before SQLite may open them.
_COMPANIONS = ("-wal", "-shm", "-journal")
_PROBE = ".probe"
_APPLICATION_ID = 0x67707564  # "gpud": marks the file as a gpudaemon spool
_SCHEMA_VERSION = 1
# Row ids are assigned by us (SQLite would pick a random id after 2**63-1 and break
# the order); well before that, the rows are renumbered from 1.
_MAX_ID = (1 << 63) - 1 - (1 << 32)


@dataclass
class Chunk:
    """The oldest spooled points, for one request: `lines` look undamaged; `invalid`
    rows did not and are dropped when the chunk is acknowledged."""

    last_id: int
    lines: list[bytes] = field(default_factory=list)
    invalid: int = 0
    size_bytes: int = 0


class Spool:
    """Not thread-safe; the InfluxDB writer serialises calls under its own lock."""

    def __init__(self, directory: str | Path, max_bytes: int) -> None:
        self.dir = Path(directory)
        self.path = self.dir / DB_NAME
        self.max_bytes = max_bytes
        self.points = 0
        # What the bound counts: the database's pages in use. The WAL gets its own
        # share of the bound (wal_bytes), so file plus WAL stay within max_bytes.
        self.size_bytes = 0
        self.payload_bytes = 0  # line-protocol bytes held, newline included
        self.wal_bytes = 0
        self._page_size = 4096
        # Files in the directory the spool does not own: for the writer to report.
        self.foreign: list[str] = []
        self._next_id = 1
        self._next_batch = 1
        # Rows sent and accepted whose deletion could not be committed yet (disk full):
        # never sent again by this process; deleted at the next chance.
        self._acked_through = 0
        self._acked_points = 0
        self._acked_bytes = 0
        self._lock_fd: int | None = None
        self._db: sqlite3.Connection | None = None
        # The last chunk read, by (first row id, max_bytes): rows are only ever deleted
        # from the front, so the same first id means the same rows.
        self._cached: tuple[tuple[int, int], Chunk] | None = None
        try:
            if self.dir.exists() and not self.dir.is_dir():  # mkdir would say "File exists"
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
            self.dir.mkdir(parents=True, exist_ok=True)
            self._lock_fd = open_own(self.dir / LOCK_NAME, os.O_RDWR | os.O_CREAT)
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self.probe()  # a read-only directory fails here, not at the first outage
            self._open_db()
            self._scan_foreign()
        except BlockingIOError:
            self.close()
            raise SpoolLockedError(
                f"spool {self.dir} is in use by another process", "in use by another process"
            ) from None
        except OSError as e:
            self.close()
            raise spool_error(self.dir, e) from None
        except sqlite3.OperationalError as e:  # cannot open, read or lock the file
            self.close()
            raise spool_error(self.path, e, "cannot open the spool database") from None
        except sqlite3.DatabaseError as e:  # damaged, or not a database at all
            self.close()
            raise SpoolError(
                f"spool {self.path}: {e}; move it away (the points in it are lost)",
                f"{DB_NAME}: {e}",
            ) from None
        except SpoolError:
            self.close()
            raise

    # -- opening -----------------------------------------------------------------

    def _open_db(self) -> None:
        for suffix in _COMPANIONS:
            check_own_file(self.dir / (DB_NAME + suffix))
        # Create or check the file ourselves (O_NOFOLLOW, type, owner) before SQLite,
        # which follows links, opens it; then make sure it is still the same file.
        fd = open_own(self.path, os.O_RDWR | os.O_CREAT)
        try:
            checked = os.fstat(fd)
        finally:
            os.close(fd)  # before SQLite takes its locks: closing would drop them
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._db = db
        st = check_own_file(self.path)
        if st is None or (st.st_dev, st.st_ino) != (checked.st_dev, checked.st_ino):
            raise SpoolError(f"spool {self.path}: replaced while opening", "replaced while opening")
        # One process (the lock above): no shared-memory index, so no -shm file.
        db.execute("PRAGMA locking_mode=EXCLUSIVE")
        app_id = db.execute("PRAGMA application_id").fetchone()[0]
        tables = db.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
        if app_id != _APPLICATION_ID and tables:
            raise SpoolError(
                f"spool {self.path}: is not a gpudaemon spool; move it away",
                f"{DB_NAME} is not a gpudaemon spool",
            )
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")  # fsync the WAL at every commit
        # The WAL is checkpointed into the file every 1/16 of the bound (1 page to
        # SQLite's default of 1000) and truncated to that size, and the database may
        # use the rest of the bound (figures: bench/spool in docs/benchmarks.md).
        page = self._page_size = db.execute("PRAGMA page_size").fetchone()[0]
        wal_pages = min(1000, max(1, self.max_bytes // 16 // page))
        db.execute(f"PRAGMA wal_autocheckpoint={wal_pages}")
        db.execute(f"PRAGMA journal_size_limit={wal_pages * page}")
        # Its share of the bound: a commit may add one batch's pages (~4) before the
        # checkpoint runs; each page has a 24-byte frame header, the file one page
        # (header, rounding). Three more pages: the database file's free pages (deleting a
        # dropped batch can leave two that the new batch does not reuse; measured by
        # tests/integration/influx/test_history.py once the table of the removed legacy
        # import no longer hid one of them among the used pages) and slack.
        self.wal_bytes = (wal_pages + 4) * (page + 24) + 4 * page
        for suffix in _COMPANIONS:
            check_own_file(self.dir / (DB_NAME + suffix))
        with self._transaction():
            db.execute(
                "CREATE TABLE IF NOT EXISTS points "
                "(id INTEGER PRIMARY KEY, batch INTEGER NOT NULL, line BLOB NOT NULL)"
            )
            db.execute(f"PRAGMA application_id={_APPLICATION_ID}")
            db.execute(f"PRAGMA user_version={_SCHEMA_VERSION}")
        self._count()

    def _count(self) -> None:
        db = self._conn()
        n, size, last_id, last_batch = db.execute(
            "SELECT count(*), coalesce(sum(length(line)) + count(*), 0), "
            "coalesce(max(id), 0), coalesce(max(batch), 0) FROM points"
        ).fetchone()
        self.points, self.payload_bytes = n, size
        self.size_bytes = self._used_bytes()
        self._next_id, self._next_batch = last_id + 1, last_batch + 1

    def _used_bytes(self) -> int:
        db = self._conn()
        pages = db.execute("PRAGMA page_count").fetchone()[0]
        free = db.execute("PRAGMA freelist_count").fetchone()[0]
        return int((pages - free) * self._page_size)

    @property
    def limit_bytes(self) -> int:
        """What the database's pages in use may reach: the bound less the WAL's share."""
        return self.max_bytes - self.wal_bytes

    def _bytes_per_payload_byte(self) -> float:
        """Disk bytes per line-protocol byte: measured on what is held, else a figure
        from bench/spool (rows of ~500 bytes take ~1.12x on disk), rounded up."""
        if self.payload_bytes >= 64 << 10:
            return max(1.0, self.size_bytes / self.payload_bytes)
        return 1.25

    def _scan_foreign(self) -> None:
        ours = {DB_NAME, LOCK_NAME, _PROBE, *(DB_NAME + s for s in _COMPANIONS)}
        reported = {f.split(" ", 1)[0] for f in self.foreign}
        for name in sorted(os.listdir(self.dir)):
            if name not in ours and name not in reported:
                self.foreign.append(name)

    # -- writing -----------------------------------------------------------------

    def append(self, lines: list[str]) -> int:
        """Store one batch durably (one transaction, fsync'd). Returns how many old
        points the bound dropped to make room, oldest batches first. If the batch
        alone is larger than the bound it is not stored and its points are returned."""
        return self._append([line.encode() for line in lines])

    def _append(self, lines: list[bytes]) -> int:
        if not lines:
            return 0
        self._retry_ack()
        size = sum(len(line) + 1 for line in lines)
        ratio = self._bytes_per_payload_byte()
        if size * ratio > self.limit_bytes:
            return len(lines)
        if self._next_id + len(lines) > _MAX_ID or self._next_batch >= _MAX_ID:
            self._renumber()
        db = self._conn()
        # Make room in the same transaction, estimated from the disk bytes per byte;
        # _trim below settles what the estimate missed.
        over = self.size_bytes + size * ratio - self.limit_bytes
        cut_id, cut_points, cut_bytes = self._oldest_batches_over(math.ceil(over / ratio))
        # Rows already sent go too, whenever something is deleted anyway.
        delete_through = cut_id or self._acked_through
        first = self._next_id
        try:
            with self._transaction():
                if delete_through:
                    db.execute("DELETE FROM points WHERE id <= ?", (delete_through,))
                db.executemany(
                    "INSERT INTO points(id, batch, line) VALUES (?, ?, ?)",
                    [(first + i, self._next_batch, line) for i, line in enumerate(lines)],
                )
        except sqlite3.Error as e:
            raise spool_error(self.path, e, f"cannot spool {len(lines)} points") from None
        self._next_id += len(lines)
        self._next_batch += 1
        if delete_through and self._acked_through:
            self._forget_acked()
        self.points += len(lines) - cut_points
        self.payload_bytes += size - cut_bytes
        self.size_bytes = self._used_bytes()
        return cut_points + self._trim()

    def _trim(self) -> int:
        """Drop oldest batches while the pages in use exceed the limit; returns the
        points dropped. A failure leaves the spool over its bound until the next
        append, which tries again."""
        dropped = 0
        while self.size_bytes > self.limit_bytes and self.waiting:
            cut_id, cut_points, cut_bytes = self._oldest_batches_over(1)
            try:
                with self._transaction():
                    self._conn().execute("DELETE FROM points WHERE id <= ?", (cut_id,))
            except sqlite3.Error:
                break
            if self._acked_through:
                self._forget_acked()
            self.points -= cut_points
            self.payload_bytes -= cut_bytes
            self.size_bytes = self._used_bytes()
            dropped += cut_points
        return dropped

    def _forget_acked(self) -> None:
        """The rows sent earlier have been deleted along with others."""
        self.points -= self._acked_points
        self.payload_bytes -= self._acked_bytes
        self._acked_through = self._acked_points = self._acked_bytes = 0

    def _oldest_batches_over(self, need: int) -> tuple[int, int, int]:
        """The last row id, point count and bytes of the fewest oldest whole batches
        (not yet acknowledged) that free at least `need` bytes; zeros if none needed."""
        if need <= 0:
            return 0, 0, 0
        freed = points = 0
        last_id, last_batch = 0, None
        rows = self._conn().execute(
            "SELECT id, batch, length(line) + 1 FROM points WHERE id > ? ORDER BY id",
            (self._acked_through,),
        )
        for row_id, batch, nbytes in rows:
            if freed >= need and batch != last_batch:
                break
            last_id, last_batch = row_id, batch
            freed += nbytes
            points += 1
        return last_id, points, freed

    def _renumber(self) -> None:
        """Move ids and batch numbers back to 1, keeping their order (the guard
        against 64-bit overflow; in practice never reached)."""
        db = self._conn()
        low_id, low_batch = db.execute(
            "SELECT coalesce(min(id), 1), coalesce(min(batch), 1) FROM points"
        ).fetchone()
        try:
            with self._transaction():
                db.execute("UPDATE points SET id = -id, batch = -batch")
                db.execute(
                    "UPDATE points SET id = -id - ?, batch = -batch - ?",
                    (low_id - 1, low_batch - 1),
                )
        except sqlite3.Error as e:
            raise spool_error(self.path, e, "cannot renumber") from None
        if self._acked_through:
            self._acked_through -= low_id - 1
        self._count()

    # -- reading -----------------------------------------------------------------

    def oldest(self, max_bytes: int) -> Chunk | None:
        """The oldest points not yet acknowledged, about `max_bytes` of them (at least
        one row); None when nothing waits. While InfluxDB is down every history run
        asks for the same chunk: it is read and checked once, then kept until rows
        before its end are deleted or acknowledged."""
        chunk: Chunk | None = None
        try:
            db = self._conn()
            first = db.execute(
                "SELECT min(id) FROM points WHERE id > ?", (self._acked_through,)
            ).fetchone()[0]
            if first is None:
                return None
            if self._cached is not None and self._cached[0] == (first, max_bytes):
                return self._cached[1]
            rows = db.execute("SELECT id, line FROM points WHERE id >= ? ORDER BY id", (first,))
            for row_id, line in rows:
                if chunk is None:
                    chunk = Chunk(row_id)
                elif chunk.size_bytes >= max_bytes:
                    break
                data = bytes(line) if isinstance(line, bytes | memoryview) else str(line).encode()
                chunk.last_id = row_id
                chunk.size_bytes += len(data) + 1
                if plausible_line(data):
                    chunk.lines.append(data)
                else:
                    chunk.invalid += 1
        except sqlite3.Error as e:
            raise spool_error(self.path, e, "cannot read") from None
        if chunk is not None:
            self._cached = ((first, max_bytes), chunk)
        return chunk

    def ack(self, chunk: Chunk) -> None:
        """Forget a chunk InfluxDB took (or refused for good). If the deletion cannot be
        committed (disk full), the chunk still counts as gone for this process and the
        deletion is retried later; SpoolError says so."""
        n = len(chunk.lines) + chunk.invalid
        self._acked_through = chunk.last_id
        self._acked_points += n
        self._acked_bytes += chunk.size_bytes
        self._retry_ack(raise_errors=True)

    def _retry_ack(self, raise_errors: bool = False) -> None:
        if not self._acked_through:
            return
        try:
            with self._transaction():
                self._conn().execute("DELETE FROM points WHERE id <= ?", (self._acked_through,))
        except sqlite3.Error as e:
            if raise_errors:
                raise spool_error(self.path, e, "cannot delete sent points") from None
            return
        self._forget_acked()
        self.size_bytes = self._used_bytes()

    def oldest_timestamp_ms(self) -> int | None:
        """The timestamp (ms, the line's last field) of the oldest point not yet sent,
        or None when nothing waits or it has none: one indexed row read."""
        try:
            row = (
                self._conn()
                .execute(
                    "SELECT line FROM points WHERE id > ? ORDER BY id LIMIT 1",
                    (self._acked_through,),
                )
                .fetchone()
            )
        except sqlite3.Error as e:
            raise spool_error(self.path, e, "cannot read") from None
        if row is None:
            return None
        line = row[0]
        data = bytes(line) if isinstance(line, bytes | memoryview) else str(line).encode()
        last = data.rstrip().rsplit(b" ", 1)[-1]
        return int(last) if last.isdigit() else None

    @property
    def waiting(self) -> int:
        """Points not yet sent (spooled minus those sent but not yet deleted)."""
        return self.points - self._acked_points

    # -- health ------------------------------------------------------------------

    def probe(self) -> None:
        """Check that the directory takes a durable write (at start, and after a
        disk-full or I/O error), without touching the database; also retries a
        deletion that could not be committed."""
        path = self.dir / _PROBE
        try:
            with contextlib.suppress(FileNotFoundError):
                check_own_file(path)
                path.unlink()
            fd = open_own(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            try:
                if os.write(fd, b"\n") != 1:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                os.fsync(fd)
            finally:
                os.close(fd)
            path.unlink()
        except OSError as e:
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
            raise spool_error(path, e) from None
        if self._db is not None:
            self._retry_ack(raise_errors=True)

    # -- lifecycle ---------------------------------------------------------------

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            raise SpoolError(f"spool {self.path}: closed", "closed")
        return self._db

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        db = self._conn()
        db.execute("BEGIN IMMEDIATE")
        try:
            yield
            db.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                db.execute("ROLLBACK")
            raise

    def close(self) -> None:
        if self._db is not None:
            with contextlib.suppress(sqlite3.Error):
                self._retry_ack()
                self._db.close()
            self._db = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None
