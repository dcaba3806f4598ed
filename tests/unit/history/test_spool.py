"""The SQLite spool: order, durability across reopen, the byte bound, only its own
regular files (symlinks, FIFOs, devices, foreign owners refused or left alone), bad
lines skipped and counted, import of the earlier segment files, id overflow, and a
real full disk (tmpfs) that never leaves a partial batch."""

from __future__ import annotations

import os
import sqlite3
import stat
import threading
from pathlib import Path

import pytest

from gpudaemon.errors import SpoolError
from gpudaemon.history.linecheck import valid_line
from gpudaemon.history.spool import DB_NAME, Spool
from tests.integration.influx.tmpfs import fill, resize, small_tmpfs


def line(i: int, pad: int = 0) -> str:
    return f"gpu,gpu=0,node=n x={i}i{',p=' + '1' * pad + 'i' if pad else ''} {1000 + i}"


def disk_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.iterdir() if p.is_file())


def drain(spool: Spool, chunk_bytes: int = 1 << 20) -> list[str]:
    out: list[str] = []
    while (chunk := spool.oldest(chunk_bytes)) is not None:
        out += [b.decode() for b in chunk.lines]
        spool.ack(chunk)
    return out


def test_batches_come_back_oldest_first_in_chunks(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=1 << 20)
    for i in range(10):
        spool.append([line(2 * i), line(2 * i + 1)])
    assert spool.points == 20
    first = spool.oldest(60)  # about two lines' worth
    assert first is not None and 1 < len(first.lines) < 20
    assert drain(spool, 60) == [line(i) for i in range(20)]
    assert spool.points == spool.waiting == spool.payload_bytes == 0


def test_spool_survives_reopen(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=1 << 20)
    spool.append([line(1), line(2)])
    spool.append([line(3)])
    spool.close()
    again = Spool(tmp_path, max_bytes=1 << 20)
    assert again.points == 3
    again.append([line(4)])
    assert drain(again) == [line(i) for i in range(1, 5)]
    again.close()
    assert Spool(tmp_path, max_bytes=1 << 20).points == 0  # acked rows are gone for good


def test_overflow_drops_oldest_whole_batches_and_reports_how_many_points(
    tmp_path: Path,
) -> None:
    bound = 200_000
    spool = Spool(tmp_path, max_bytes=bound)
    dropped = 0
    for i in range(300):
        dropped += spool.append([line(2 * i, pad=450), line(2 * i + 1, pad=450)])
        assert spool.size_bytes <= spool.limit_bytes  # the database's pages in use
        assert disk_bytes(tmp_path) <= bound  # the files, WAL included
    assert dropped > 0 and dropped % 2 == 0  # whole batches
    assert dropped + spool.points == 600
    kept = [int(s.split("x=")[1].split("i")[0]) for s in drain(spool)]
    assert kept == list(range(600 - len(kept), 600))  # the newest survive, contiguous


def test_a_batch_larger_than_the_bound_is_not_stored(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=64 << 10)
    spool.append([line(0)])
    assert spool.append([line(1, pad=60_000)]) == 1
    assert drain(spool) == [line(0)]


def test_second_process_cannot_share_a_spool(tmp_path: Path) -> None:
    first = Spool(tmp_path, max_bytes=1000)
    with pytest.raises(SpoolError, match="in use"):
        Spool(tmp_path, max_bytes=1000)
    first.close()
    Spool(tmp_path, max_bytes=1000).close()


def test_unwritable_directory_is_a_spool_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(SpoolError):
        Spool(blocker / "spool", max_bytes=1000)


# -- only its own regular files --------------------------------------------------


def test_database_that_is_a_symlink_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    target = tmp_path / "passwd"
    target.write_text("root:x:0:0::/root:/bin/sh\n")
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir()
    (spool_dir / DB_NAME).symlink_to(target)
    with pytest.raises(SpoolError, match="is a symbolic link; the spool only opens its own"):
        Spool(spool_dir, max_bytes=1000)
    assert target.read_text() == "root:x:0:0::/root:/bin/sh\n"
    Spool(tmp_path / "other", max_bytes=1000).close()  # the lock was released


def test_database_that_is_a_fifo_is_refused_without_hanging(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / DB_NAME)
    result: list[BaseException] = []

    def open_it() -> None:
        try:
            Spool(tmp_path, max_bytes=1000)
        except BaseException as e:
            result.append(e)

    t = threading.Thread(target=open_it, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "opening a spool whose database is a FIFO hung"
    assert isinstance(result[0], SpoolError)
    assert "is a FIFO, not a regular file" in str(result[0])


def test_database_that_is_a_device_is_refused(tmp_path: Path) -> None:
    os.mknod(tmp_path / DB_NAME, stat.S_IFCHR | 0o600, os.makedev(1, 3))  # /dev/null
    with pytest.raises(SpoolError, match="is a character device, not a regular file"):
        Spool(tmp_path, max_bytes=1000)


def test_database_owned_by_someone_else_is_refused(tmp_path: Path) -> None:
    db = tmp_path / DB_NAME
    db.write_bytes(b"")
    os.chown(db, 12345, 12345)
    with pytest.raises(SpoolError, match="owned by uid 12345"):
        Spool(tmp_path, max_bytes=1000)


def test_wal_that_is_a_symlink_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "victim"
    target.write_text("keep me")
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir()
    (spool_dir / f"{DB_NAME}-wal").symlink_to(target)
    with pytest.raises(SpoolError, match="symbolic link"):
        Spool(spool_dir, max_bytes=1000)
    assert target.read_text() == "keep me"


def test_hard_link_to_a_database_is_refused(tmp_path: Path) -> None:
    other = tmp_path / "elsewhere.db"
    other.write_bytes(b"")
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir()
    os.link(other, spool_dir / DB_NAME)
    with pytest.raises(SpoolError, match="2 hard links"):
        Spool(spool_dir, max_bytes=1000)


def test_a_file_that_is_not_a_spool_is_refused(tmp_path: Path) -> None:
    (tmp_path / DB_NAME).write_text("just some text\n" * 100)
    with pytest.raises(SpoolError, match="not a database"):
        Spool(tmp_path, max_bytes=1000)
    other = tmp_path / "x"
    other.mkdir()
    con = sqlite3.connect(other / DB_NAME)
    con.execute("CREATE TABLE accounts (id INTEGER)")
    con.commit()
    con.close()
    with pytest.raises(SpoolError, match="not a gpudaemon spool"):
        Spool(other, max_bytes=1000)


def test_foreign_files_are_reported_and_left_alone(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("someone else's")
    (tmp_path / "link").symlink_to("/etc/hostname")
    spool = Spool(tmp_path, max_bytes=1000)
    assert sorted(spool.foreign) == ["link", "notes.txt"]
    spool.append([line(1)])
    spool.close()
    assert (tmp_path / "notes.txt").read_text() == "someone else's"
    assert (tmp_path / "link").is_symlink()


# -- bad lines, the earlier format, overflow of ids ------------------------------


def test_a_garbage_row_is_skipped_and_counted_the_rest_is_kept(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=1 << 20)
    spool.append([line(1), line(2), line(3)])
    spool.close()
    con = sqlite3.connect(tmp_path / DB_NAME)
    con.execute("UPDATE points SET line = ? WHERE line = ?", (b"\x00\x00garb", line(2).encode()))
    con.commit()
    con.close()
    spool = Spool(tmp_path, max_bytes=1 << 20)
    chunk = spool.oldest(1 << 20)
    assert chunk is not None
    assert [b.decode() for b in chunk.lines] == [line(1), line(3)]
    assert chunk.invalid == 1
    spool.ack(chunk)
    assert spool.points == 0


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        (line(1), True),
        ('gpu,a=b\\ c s="x y",f=1.5e3,t=true -5', True),
        ("", False),
        ("\x00" * 40, False),
        (line(1)[:-3] + "\x00\x00\x00", False),  # NUL padding after a short write
        (line(1)[:20], False),  # torn
        ("gpu,node=n x=1i", False),  # no timestamp
        ("not line protocol at all", False),
    ],
)
def test_valid_line(text: str, ok: bool) -> None:
    assert valid_line(text.encode()) is ok


def test_a_symlink_in_the_spool_dir_is_left_alone(tmp_path: Path) -> None:
    target = tmp_path / "system-file"
    target.write_text(f"{line(99)}\n")
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir()
    seg = spool_dir / f"seg-{1:020d}.lp"
    seg.symlink_to(target)
    spool = Spool(spool_dir, max_bytes=1 << 20)
    assert spool.points == 0  # the target's contents are not queued for InfluxDB
    assert spool.foreign == [seg.name]
    spool.append([line(1)])
    spool.close()
    assert target.read_text() == f"{line(99)}\n"
    assert seg.is_symlink()


def test_ids_near_the_64_bit_limit_are_renumbered_keeping_order(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=1 << 20)
    spool.append([line(1), line(2)])
    spool.close()
    con = sqlite3.connect(tmp_path / DB_NAME)
    con.execute("UPDATE points SET id = id + ?, batch = batch + ?", ((1 << 63) - 10, (1 << 63) - 5))
    con.commit()
    con.close()
    spool = Spool(tmp_path, max_bytes=1 << 20)
    for i in range(3, 8):
        spool.append([line(i)])
    spool.close()
    again = Spool(tmp_path, max_bytes=1 << 20)  # all visible after a restart
    assert again.points == 7
    assert drain(again) == [line(i) for i in range(1, 8)]


# -- a real full disk --------------------------------------------------------------


def test_full_disk_never_leaves_a_partial_batch_and_recovers(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "mnt", "256k") as mnt:
        spool = Spool(mnt / "spool", max_bytes=1 << 20)
        stored: list[str] = []
        failed = 0
        for i in range(2000):
            batch = [line(10 * i + k, pad=40) for k in range(8)]
            try:
                spool.append(batch)
                stored += batch
            except SpoolError as e:
                assert "No space left on device" in str(e)
                failed += 1
                if failed == 3:
                    break
        assert failed == 3, "the 256k tmpfs never filled up"
        assert spool.points == len(stored)
        fill(mnt)
        resize(mnt, "4m")
        spool.append([line(99_999)])
        spool.close()
        again = Spool(mnt / "spool", max_bytes=1 << 20)
        got = drain(again)
        assert got == [*stored, line(99_999)]  # every committed batch whole, nothing else
        again.close()
